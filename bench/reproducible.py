"""What ``fit(reproducible=True, micro_batch_size=k)`` costs against the ordinary step.

Run: python bench/reproducible.py [--rounds 3] [--quick] [--json out.json]
(``--quick``: small data, the two-replica pair once: a smoke test, not a measurement.)

The same fit (a small CNN with BatchNorm and dropout, Adam, in-memory images, batch 64) on
one CPU replica and on two, in the ordinary step and in the reproducible mode at
micro-batches of 16 and 8 rows. Each case runs in a process of its own (rounds interleave
the cases): time per optimizer step (median over the timed epochs, after one warm-up
epoch, one intra-op thread per process), and the peak resident memory of the process
during training above what it held before ``fit`` (``resource.getrusage``'s
``ru_maxrss``: torch's CPU allocations included, which ``tracemalloc`` does not see).
Prints each case, then the ratios reproducible / ordinary per replica count (time and
memory).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's fitdp

import fitdp  # noqa: E402

CASES = {  # name: (replicas, micro_batch_size or None for the ordinary step)
    "ordinary-1": (1, None), "micro16-1": (1, 16), "micro8-1": (1, 8),
    "ordinary-2": (2, None), "micro16-2": (2, 16), "micro8-2": (2, 8),
}


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(32, 10))


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def run_case(name: str, quick: bool) -> dict[str, float]:
    """One case in this process: seconds per step and peak memory above the start."""
    replicas, micro = CASES[name]
    torch.set_num_threads(1)  # one intra-op thread, as bench/overhead.py: stabler times
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
    model.fit(x, y, batch_size=64, epochs=epochs, verbose=0, seed=0,
              devices=["cpu"] * replicas, callbacks=[Timer()],
              reproducible=micro is not None, micro_batch_size=micro)
    steps = -(-rows // 64)
    return {"ms_per_step": 1e3 * statistics.median(times[1:]) / steps,
            "peak_mb": rss_mb() - before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="small data, one round")
    parser.add_argument("--json", help="write the medians here")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # (a worker process)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case, args.quick)))
        return
    rounds = 1 if args.quick else args.rounds
    # --quick: a smoke test of the two-replica pair only (each process costs an import)
    names = ["ordinary-2", "micro8-2"] if args.quick else list(CASES)
    got: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            cmd = [sys.executable, __file__, "--case", name] + (["--quick"] if args.quick else [])
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
            got[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    medians = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
               for name, runs in got.items()}
    for name, m in medians.items():
        print(f"{name:12s} {m['ms_per_step']:8.2f} ms/step  peak +{m['peak_mb']:7.1f} MB")
    for n in (1, 2):
        base = medians.get(f"ordinary-{n}")
        for k in (16, 8):
            mode = medians.get(f"micro{k}-{n}")
            if base is None or mode is None:
                continue
            print(f"reproducible (micro_batch_size={k}) / ordinary, {n} replica(s): "
                  f"time {mode['ms_per_step'] / base['ms_per_step']:.2f}x, "
                  f"peak memory {mode['peak_mb']:+.1f} MB vs {base['peak_mb']:+.1f} MB")
    if args.json:
        Path(args.json).write_text(json.dumps(medians, indent=2))


if __name__ == "__main__":
    main()
