"""What ``fit(reproducible=True, micro_batch_size=k)`` costs against the ordinary step: the
same fit of a small CNN on one CPU replica and on two, time per step and peak memory.

Run: python bench/reproducible.py [--repeats 3] [--quick] [--json out.json]
(``--quick``: small data, the two-replica pair once: a smoke test, not a measurement.)

The fit: a small CNN with BatchNorm and dropout, Adam, in-memory images, batch 64, in the
ordinary step and in the reproducible mode at micro-batches of 16 and 8 rows. Each case runs
in a process of its own (``--repeats`` rounds interleave the cases; one torch thread per
process, ``common.pin_threads``): time per optimizer step (median over the timed epochs,
after one warm-up epoch), and the peak resident memory of the process during training above
what it held before ``fit`` (``resource.getrusage``'s ``ru_maxrss``: torch's CPU allocations
included, which ``tracemalloc`` does not see). A row per replica count and micro-batch size:
reproducible against ordinary, time and memory.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
from common import TAG, Results, emit, parser, pin_threads
from torch import nn

import fitdp

CASES = {  # name: (replicas, micro_batch_size or None for the ordinary step)
    "ordinary-1": (1, None), "micro16-1": (1, 16), "micro8-1": (1, 8),
    "ordinary-2": (2, None), "micro16-2": (2, 16), "micro8-2": (2, 8),
}
BATCH = 64


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(32, 10))


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def run_case(name: str, quick: bool) -> dict[str, float]:
    """One case in this process: ms per step and peak memory (MB) above the start."""
    replicas, micro = CASES[name]
    pin_threads()
    rows, side, epochs = (128, 16, 2) if quick else (1024, 32, 4)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 3, side, side, generator=g)
    y = torch.randint(0, 10, (rows,), generator=g)
    model = fitdp.Model(cnn())
    model.compile("adam", "cross_entropy", lr=1e-3)
    times: list[float] = []

    class Timer(fitdp.callbacks.Callback):
        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            times.append(time.perf_counter() - self.start)

    before = rss_mb()
    model.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0, seed=0,
              devices=["cpu"] * replicas, callbacks=[Timer()],
              reproducible=micro is not None, micro_batch_size=micro)
    steps = -(-rows // BATCH)
    return {"ms_per_step": 1e3 * statistics.median(times[1:]) / steps,
            "peak_mb": rss_mb() - before}


def in_process(name: str, quick: bool) -> dict[str, float]:
    """``run_case`` in a fresh process (its peak memory is the case's alone)."""
    cmd = [sys.executable, __file__, "--case", name] + ["--quick"] * quick
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600).stdout
    return next(json.loads(ln[len(TAG):]) for ln in out.splitlines() if ln.startswith(TAG))


def main() -> None:
    p = parser(__doc__, repeats=3)
    p.add_argument("--case", help=argparse.SUPPRESS)  # (a case's own process)
    args = p.parse_args()
    if args.case:
        emit(run_case(args.case, args.quick))
        return
    out = Results("reproducible", args)
    # --quick: a smoke test of the two-replica pair only (each process costs an import)
    names = ["ordinary-2", "micro8-2"] if args.quick else list(CASES)
    got: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for _ in range(1 if args.quick else args.repeats):
        for name in names:
            got[name].append(in_process(name, args.quick))
    medians = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
               for name, runs in got.items()}
    out.extra["medians"] = medians
    for n in (1, 2):
        base = medians.get(f"ordinary-{n}")
        for k in (16, 8):
            mode = medians.get(f"micro{k}-{n}")
            if base is None or mode is None:
                continue
            case = f"CNN, batch {BATCH}, {n} replica(s): micro_batch_size={k}"
            out.row("time", f"{case}, time per step", "ordinary step", base["ms_per_step"],
                    mode["ms_per_step"], "ms")
            out.row("memory", f"{case}, peak memory above the start", "ordinary step",
                    base["peak_mb"], mode["peak_mb"], "MB")
    out.finish()


if __name__ == "__main__":
    main()
