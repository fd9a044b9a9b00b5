"""Run every benchmark in bench/, print one table of ratios, write docs/benchmarks.md and charts.

Run: python bench/run.py [--quick] [--out docs] [--only overhead,bucketing]
 or: python -m bench [same options]
 or: python -m bench --gpu [bench/gpu.py's options]   (the GPU checks: bench/gpu.py)

Each benchmark runs as its own process with ``--json`` (and ``--quick`` under ``--quick``), one
after the other, so they never share the CPU with each other; their output streams through.
A benchmark that is missing, not installed (the Keras peer) or fails is noted and the others
still run. The page ``<out>/benchmarks.md`` and the charts ``<out>/img/*.png`` are rewritten
from this run's numbers only. The exit code is 1 if a benchmark failed, else 0 (a MISSED
target is a result, not a failure).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import charts
import summary
from report import Section, page

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


@dataclass(frozen=True)
class Bench:
    name: str
    script: str
    quick: tuple[str, ...]  # the flags of a --quick run
    timeout_s: float  # of a full run; a quick run gets QUICK_TIMEOUT_S
    needs: str | None = None  # a module it imports that fitdp does not depend on
    program: str | None = None  # a program it runs that is not part of Python


QUICK_TIMEOUT_S = 150.0
BENCHES = (
    Bench("overhead", "overhead.py", ("--quick",), 600),
    Bench("keras_peer", "keras_peer.py", ("--quick",), 600, needs="keras"),
    Bench("checkpoint", "checkpoint.py", ("--quick",), 1500),  # 3 fits of the stall: minutes
    Bench("bucketing", "bucketing.py", ("--quick",), 900),
    Bench("replica_memory", "replica_memory.py", ("--quick",), 600),
    # Quick: (a) and (b) only; the Lightning and one-process launches add ~30 s of start-up.
    Bench("distributed", "distributed.py", ("--quick", "--cases", "ab"), 900),
    Bench("sharding", "sharding.py", ("--quick",), 900),
    Bench("instructions", "instructions.py", ("--quick",), 900, program="valgrind"),
)


@dataclass
class Outcome:
    data: dict[str, Any] | None = None
    problem: str | None = None  # why there are no (or partial) numbers
    failed: bool = False  # a crash or timeout, not a skip
    tail: str = ""  # the end of the output of a failed run
    seconds: float = 0.0
    load_before: str = ""
    load_after: str = ""

    def facts(self) -> list[str]:
        if not self.load_before:
            return []
        return [f"ran in {self.seconds:.0f} s; load average (1, 5, 15 min) before "
                f"{self.load_before}, after {self.load_after}"]


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def why_not(bench: Bench, quick: bool) -> str | None:
    """Why ``bench`` cannot run here, or None."""
    path = HERE / bench.script
    if not path.exists():
        return f"bench/{bench.script} is not there yet: skipped"
    text = path.read_text()
    for flag in ("--json", "--quick" if quick else None):
        if flag and f'"{flag}"' not in text:
            return f"bench/{bench.script} has no {flag} flag yet: skipped"
    if bench.needs and importlib.util.find_spec(bench.needs) is None:
        return f"{bench.needs} not installed: skipped"
    if bench.program and shutil.which(bench.program) is None:
        return f"{bench.program} is not on PATH: skipped"
    return None


def run_one(bench: Bench, quick: bool, folder: Path) -> Outcome:
    """Run one benchmark, streaming its output; kill its whole process group on timeout."""
    out = folder / f"{bench.name}.json"
    cmd = [sys.executable, str(HERE / bench.script), "--json", str(out),
           *(bench.quick if quick else ())]
    timeout = QUICK_TIMEOUT_S if quick else bench.timeout_s
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "KERAS_BACKEND": "torch"}
    print(f"\n== {bench.name}: {' '.join(cmd[1:])}  [load average {loadavg()}]", flush=True)
    result = Outcome(load_before=loadavg())
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    timed_out = threading.Event()

    def kill() -> None:
        timed_out.set()
        os.killpg(proc.pid, signal.SIGKILL)

    timer = threading.Timer(timeout, kill)
    tail: collections.deque[str] = collections.deque(maxlen=40)
    timer.start()
    try:
        for line in proc.stdout or ():
            tail.append(line)
            print("   " + line, end="", flush=True)
        code = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:  # interrupted: leave no benchmark (or torchrun rank) behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    result.seconds, result.load_after = time.perf_counter() - start, loadavg()
    try:
        result.data = json.loads(out.read_text())
    except (OSError, ValueError):  # none written, or torn by a kill: counted below
        result.data = None
    if code != 0:
        result.failed = True
        result.tail = "".join(tail)
        result.problem = (f"timed out after {timeout:.0f} s" if timed_out.is_set()
                          else f"exit code {code}")
        if result.data is not None:
            result.problem += "; its JSON holds the cases that finished"
    elif result.data is None:
        result.failed, result.problem = True, "wrote no JSON"
    return result


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine(load_start: str, load_end: str, seconds: float) -> list[tuple[str, str]]:
    cpu = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as f:
        mem_kb = int(f.readline().split()[1])
    cores = f"{os.cpu_count()} ({len(os.sched_getaffinity(0))} usable by this process)"
    peers = ", ".join(f"{name} {v}" for name, dist in (("Keras", "keras"),
                                                       ("Lightning", "lightning"))
                      if (v := version(dist))) or "none installed"
    return [("CPU", cpu), ("cores", cores), ("memory", f"{mem_kb / 2**20:.1f} GiB"),
            ("OS", platform.platform()), ("Python", platform.python_version()),
            ("torch", f"{version('torch')} (one thread per process)"), ("peers", peers),
            ("load average (1, 5, 15 min)", f"{load_start} at the start, {load_end} at the end"),
            ("duration", f"{seconds / 60:.1f} min for all benchmarks")]


ABOUT = {
    "overhead": "`Model.fit` against a hand-written loop over pre-shuffled tensor slices (same "
                "model, data, Adam and steps), interleaved, median time per step; and two "
                "replica threads (`devices=[\"cpu\", \"cpu\"]`) against one. The Keras 3 peer "
                "(torch backend, `bench/keras_peer.py`) times `model.fit` on the same two MLPs "
                "against the same hand loop, interleaved in its own process.",
    "checkpoint": "A 25M-parameter MLP with Adam state: `save_checkpoint` (atomic, sealed, "
                  "fsyncs file and folder) against `torch.save` + fsync of the same state; the "
                  "training time `model.save(async_save=True)` costs inside `fit` against a "
                  "synchronous `model.save` (rounds of blocks of steps without a save, with an "
                  "async save, with a sync save; paired per round; medians and interquartile "
                  "ranges; `bench/save_stall.py`), in one process and under torchrun with "
                  "`\"ddp\"` and `\"fsdp\"`; and `copy_to` from two CPU replicas against a "
                  "memcpy.",
    "bucketing": "A GRU classifier on 4,000 sequences with log-normal lengths in [4, 256]: "
                 "real tokens/s (padding excluded, per second of CPU time of the fastest epoch) "
                 "of three hand loops and `fitdp.BucketIterator`, and the memory of 20 buckets "
                 "against the largest bucket alone.",
    "replica_memory": "Peak RSS of a 21M-parameter MLP trained with SGD on 1, 2 and 3 CPU "
                      "replicas (median of fresh processes): what one extra replica costs, as "
                      "a multiple of the weights' bytes (docs/devices.md gives the arithmetic).",
    "distributed": "The same MLP, data and order under torchrun (2 ranks, gloo on 127.0.0.1): "
                   "fitdp against a hand-written `DistributedDataParallel` loop and Lightning; "
                   "and fitdp in one process with two replica threads.",
    "sharding": "`Model.fit` with `compile(strategy=\"fsdp\")` against `strategy=\"ddp\"` "
                "under torchrun (2 ranks, gloo on 127.0.0.1), a 25M-parameter MLP with Adam: "
                "the bytes each rank's optimizer steps (its parameter shards, their gradients, "
                "Adam's moments; `to_local()` of FSDP2's DTensors), each rank's peak RSS "
                "growth, and the time per step.",
    "instructions": "The machine instructions one training step executes (valgrind's "
                    "callgrind, every thread), fitdp against the floor loop (one CPU device) "
                    "and the hand-written two-thread loop (two CPU replicas), from two epoch "
                    "lengths so the per-fit cost drops out: the overhead without the "
                    "machine's noise (it does not see cache misses or lock waits).",
}
TITLES = {"overhead": "Overhead per step", "checkpoint": "Checkpoints",
          "bucketing": "Bucketing", "replica_memory": "Memory per CPU replica",
          "distributed": "Distributed (torchrun, CPU)",
          "sharding": "FSDP against DDP (torchrun, CPU)",
          "instructions": "Instructions per step (valgrind)"}


def build(name: str, outcomes: dict[str, Outcome], img: Path, note: str,
          ) -> tuple[Section, list[summary.Ratio]]:
    """One section of the page, with its chart written under ``img``."""
    got = outcomes[name]
    s = Section(TITLES[name], f"python bench/{name}.py", ABOUT[name], got.facts(),
                problem=got.problem, failed=got.failed, output_tail=got.tail)
    makers: dict[str, tuple[Callable[..., Any], Callable[..., None], tuple[Any, ...]]] = {
        "overhead": (summary.overhead, charts.overhead, (outcomes["keras_peer"].data,)),
        "checkpoint": (summary.checkpoint, charts.checkpoint, ()),
        "bucketing": (summary.bucketing, charts.bucketing, ()),
        "replica_memory": (summary.replica_memory, charts.replica_memory, ()),
        "distributed": (summary.distributed, charts.distributed, ()),
        "sharding": (summary.sharding, charts.sharding, ()),
        "instructions": (summary.instructions, charts.instructions, ()),
    }
    tables, chart, extra = makers[name]
    (img / f"{name}.png").unlink(missing_ok=True)  # no chart from an earlier run stays behind
    if name == "overhead":
        keras = outcomes["keras_peer"]
        s.facts += [f"Keras peer: {f}" for f in keras.facts()]
        if keras.problem:
            s.facts.append(f"Keras peer: {keras.problem}")
    if got.data is None:
        return s, []
    try:
        s.ratios, s.details = tables(got.data, *extra)
        chart(got.data, *extra, img / f"{name}.png", note)
        s.chart = f"{name}.png"
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:  # a changed JSON layout
        s.problem = f"could not read its JSON ({type(exc).__name__}: {exc})"
        s.failed = True
    return s, s.ratios


def main() -> int:
    if "--gpu" in sys.argv[1:]:  # the GPU checks; the options after it are bench/gpu.py's
        import gpu  # noqa: PLC0415

        return gpu.main([a for a in sys.argv[1:] if a != "--gpu"])
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="smoke runs of every benchmark (about a minute and a half)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs",
                        help="folder for benchmarks.md and img/ (default: docs/)")
    parser.add_argument("--gpu", action="store_true",
                        help="run bench/gpu.py instead (the GPU checks; see its --help)")
    parser.add_argument("--only", default=None,
                        help="comma-separated benchmarks to run: "
                             + ",".join(b.name for b in BENCHES))
    args = parser.parse_args()
    only = set(args.only.split(",")) if args.only else {b.name for b in BENCHES}
    unknown = only - {b.name for b in BENCHES}
    if unknown:
        parser.error(f"--only got {', '.join(sorted(unknown))}; expected some of "
                     f"{', '.join(b.name for b in BENCHES)}")

    load_start, start = loadavg(), time.perf_counter()
    outcomes: dict[str, Outcome] = {}
    with tempfile.TemporaryDirectory(prefix="fitdp-bench-") as tmp:
        for bench in BENCHES:
            reason = "not in --only" if bench.name not in only else why_not(bench, args.quick)
            if reason:
                print(f"\n== {bench.name}: {reason}", flush=True)
                outcomes[bench.name] = Outcome(problem=reason)
            else:
                outcomes[bench.name] = run_one(bench, args.quick, Path(tmp))
    seconds, load_end = time.perf_counter() - start, loadavg()

    img = args.out / "img"
    img.mkdir(parents=True, exist_ok=True)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    note = f"{when}{' (quick run)' if args.quick else ''}; load average {load_start} at the start"
    sections, ratios = [], []
    for name in TITLES:
        section, rows = build(name, outcomes, img, note)
        sections.append(section)
        ratios += rows

    print(f"\nfitdp against the hand-written reference ({'quick' if args.quick else 'full'} run); "
          f"load average {load_start} at the start, {load_end} at the end")
    print(summary.ratio_table(ratios).text())
    for name, got in outcomes.items():
        if got.problem:
            print(f"{name}: {got.problem}")
    for s in sections:
        if s.problem and s.problem not in (o.problem for o in outcomes.values()):
            print(f"{s.title}: {s.problem}")

    command = "python bench/run.py" + (" --quick" if args.quick else "")
    if args.out.resolve() != (ROOT / "docs").resolve():
        command += f" --out {args.out}"
    if args.only:
        command += f" --only {args.only}"
    text = page(command, when, machine(load_start, load_end, seconds), ratios, sections,
                args.quick)
    (args.out / "benchmarks.md").write_text(text)
    print(f"\nwrote {args.out / 'benchmarks.md'} and {len(list(img.glob('*.png')))} chart(s) "
          f"in {img}")
    return 1 if any(o.failed for o in outcomes.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
