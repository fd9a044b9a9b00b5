"""Instructions per training step, fitdp against the hand loops, counted by valgrind.

Run: python tools/instructions.py [--json out.json] [--quick]

The timing benchmarks (bench/overhead.py, bench/replicas.py) read a few percent of overhead on
a quiet machine and anything on a loaded one: on the shared 2-core box, the same two builds
swapped order from run to run. This one counts the work itself. Each loop runs in its own process
under ``valgrind --tool=callgrind`` with instrumentation off (a fast-forward through imports
and one warm-up epoch); then ``callgrind_control -i on`` counts one epoch of ``n`` steps to
the process's exit. Two epoch lengths give the cost per step without the per-fit cost:
``(I(n2) - I(n1)) / (n2 - n1)``. The count includes every thread (valgrind runs them one at
a time), torch's kernels and the interpreter; it does not see cache misses, lock waits or
the scheduler, which is what the timing benchmarks add.

Cases: the tiny MLP of bench/overhead.py (fitdp on one CPU device against the floor loop), and
the small two-replica MLP of bench/replicas.py (``devices=["cpu", "cpu"]`` against the hand-written
two-thread loop): where a step is mostly Python, so overhead shows. The larger MLPs spend
their instructions in the same BLAS kernels on both sides, and a counted epoch of them takes
many minutes under valgrind (the 784-512-512 case ran over 7 minutes for 14 steps).
Needs ``valgrind`` on PATH (the script says so and exits 0 without it). A full run takes
about 4 minutes on 2 cores; ``--quick`` counts the tiny case on short epochs (a minute).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
CASES = {  # name: (layer sizes, batch, devices, (n1, n2) steps)
    "tiny": ([32, 64, 64, 10], 32, 1, (40, 240)),
    "replicas_128": ([128, 128, 128, 10], 64, 2, (20, 100)),
}
QUICK = {"tiny": (5, 25)}  # a smoke run that the bench's quick budget holds
TARGETS = {"tiny": ("<=", 1.05), "replicas_128": ("<=", 1.05)}  # fitdp / hand, per step


def child(case: str, which: str, steps: int, mark: str) -> None:
    """Build the loop, run one warm-up epoch, signal ``mark``, wait, run one counted epoch."""
    sys.path.insert(0, str(BENCH))
    import common  # noqa: PLC0415 - bench/common.py: the loops the timing benchmarks run

    common.pin_threads()
    sizes, bs, devices, _ = CASES[case]
    x, y = common.synthetic(bs * steps, sizes[0], sizes[-1])
    net = common.mlp(sizes)
    if devices == 1:
        epoch = (common.hand_loop(net, x, y, bs) if which == "hand"
                 else common.fitdp_loop(net, x, y, bs, ["cpu"]))
    else:
        epoch = (common.hand_two_threads(net, x, y, bs) if which == "hand"
                 else common.fitdp_loop(net, x, y, bs, ["cpu"] * devices))
    epoch()
    Path(mark).touch()
    while not Path(mark + ".on").exists():
        time.sleep(0.05)
    epoch()
    os._exit(0)  # the count ends here: no interpreter teardown in it


def count(case: str, which: str, steps: int, tmp: Path) -> int:
    """Instructions of one counted epoch of ``steps`` steps (see the module docstring)."""
    tag = f"{case}-{which}-{steps}"
    mark, out = tmp / f"{tag}.mark", tmp / f"{tag}.out"
    proc = subprocess.Popen(
        ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
         sys.executable, __file__, "--child", case, which, str(steps), str(mark)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while not mark.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"{tag}: the child exited early: {proc.stderr.read()[-2000:]}")
        time.sleep(0.2)
    subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    (tmp / f"{tag}.mark.on").touch()
    _, err = proc.communicate(timeout=1800)
    found = re.findall(r"Collected : (\d+)", err)
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"{tag}: valgrind exited {proc.returncode}: {err[-2000:]}")
    return int(found[-1])


def per_step(case: str, which: str, steps: tuple[int, int], tmp: Path,
             pool: ThreadPoolExecutor) -> float:
    n1, n2 = steps
    a, b = pool.map(lambda n: count(case, which, n, tmp), (n1, n2))
    return (b - a) / (n2 - n1)


def main() -> None:
    sys.path.insert(0, str(BENCH))
    import common  # noqa: PLC0415 - bench/common.py: the options and the result rows

    parser = common.parser(__doc__)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        case, which, steps, mark = args.child
        child(case, which, int(steps), mark)
    out = common.Results("instructions", args)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("valgrind (with callgrind_control) is not on PATH: nothing counted")
        out.extra["skipped"] = "valgrind is not on PATH"
        return out.finish()
    plan = QUICK if args.quick else {k: v[3] for k, v in CASES.items()}
    with tempfile.TemporaryDirectory(prefix="fitdp-instr-") as d, ThreadPoolExecutor(2) as pool:
        for case, steps in plan.items():
            fitdp_, hand = (per_step(case, w, steps, Path(d), pool) for w in ("fitdp", "hand"))
            op, target = TARGETS[case]
            sizes, bs, devices, _ = CASES[case]
            out.row("instructions", f"MLP {'-'.join(map(str, sizes))}, batch {bs}, {devices} "
                    "CPU device(s): instructions per step", "hand loop", hand, fitdp_,
                    "instructions", None, op, target, f"epochs of {steps[0]} and {steps[1]} steps")
    out.finish()


if __name__ == "__main__":
    main()
