"""What ``import fitdp`` costs on top of its core dependencies: a fresh ``python -c "import
torch, torchmetrics"`` against ``python -c "import torch, torchmetrics, fitdp"``, interleaved
(a load change hits both alike), medians of the rounds' differences. Importing runs on one
thread, so on an idle machine its wall clock is its CPU time; on a shared one the wall clock
also counts the waits for a core, and the CPU time (user + system, of the child) is what
stays put: the target is checked on it, and both are printed.

Target (issue 30): at most 0.3 s more. Distributed checkpointing, DTensor/FSDP2, ONNX,
transformers, matplotlib and the like load when a call uses them, not at ``import fitdp``
(tests/test_imports.py pins which modules stay out).

Run: python bench/import_time.py [--runs N] [--quick]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # ``python -c`` imports fitdp from the cwd
REFERENCE = "import torch, torchmetrics"
WITH_FITDP = "import torch, torchmetrics, fitdp"
TARGET_S = 0.3


def seconds(code: str) -> tuple[float, float]:
    """Wall clock and CPU time of a fresh interpreter running ``code`` (start-up included:
    it is the same in both cases and cancels in the difference)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=9, help="rounds (each runs both cases)")
    parser.add_argument("--quick", action="store_true", help="3 rounds (the smoke test)")
    args = parser.parse_args()
    runs = 3 if args.quick else args.runs
    seconds(WITH_FITDP)  # warm the file cache; not counted
    reference, with_fitdp = [], []
    for i in range(runs):  # alternate which goes first: neither always follows the other
        pair = (REFERENCE, WITH_FITDP) if i % 2 == 0 else (WITH_FITDP, REFERENCE)
        times = {code: seconds(code) for code in pair}
        reference.append(times[REFERENCE])
        with_fitdp.append(times[WITH_FITDP])
    extra = {}
    for k, kind in enumerate(("wall clock", "CPU time")):
        a = statistics.median(r[k] for r in reference)
        b = statistics.median(w[k] for w in with_fitdp)
        extra[kind] = statistics.median(w[k] - r[k] for w, r in zip(with_fitdp, reference))
        print(f"{kind}: {REFERENCE!r} {a:.3f} s, {WITH_FITDP!r} {b:.3f} s (medians of "
              f"{runs} rounds); import fitdp on top {extra[kind]:.3f} s (median of the "
              f"rounds' differences)")
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"import fitdp on top of torch + torchmetrics, CPU time: {extra['CPU time']:.3f} s; "
          f"target <= {TARGET_S} s: {'met' if extra['CPU time'] <= TARGET_S else 'NOT met'} "
          f"(load average {load})")


if __name__ == "__main__":
    main()
