"""Peak memory an extra CPU replica costs, as a multiple of the model's weights.

Run: python bench/replica_memory.py [--repeats 3] [--json out.json] [--quick]

A 21M-parameter MLP (1024-4096-4096-10, float32: 84 MB of weights) trains a few SGD steps
(no momentum: no optimizer state) with ``Model.fit(devices=["cpu"] * n)`` for n = 1, 2, 3,
each in a fresh process (its own peak, nothing left over from another run), ``--repeats``
processes per n, median peak RSS (``getrusage(RUSAGE_SELF).ru_maxrss``; tracemalloc does not
see torch's allocations). The cost of an extra replica is ``(peak(3) - peak(1)) / 2`` over
the weights' bytes; both steps (1 -> 2, 2 -> 3) are printed too: 1 -> 2 also pays the
one-off costs of running in parallel at all (a second device thread, its allocator arena).
docs/devices.md gives the arithmetic.

Target: <= 2.3x the weights per extra replica (its parameters and gradients, once each).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's fitdp
import fitdp  # noqa: E402

SIZES = [1024, 4096, 4096, 10]
QUICK_SIZES = [256, 1024, 1024, 10]  # 1.3M parameters: a smoke run, the target does not apply
BATCH, STEPS = 64, 4
REPLICAS = (1, 2, 3)
TARGET = 2.3


def mlp(sizes: list[int]) -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def measure(replicas: int, sizes: list[int]) -> dict[str, Any]:
    """Peak RSS of ``STEPS`` SGD steps on ``replicas`` CPU replicas, in this process."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = mlp(sizes)
    weights = sum(p.numel() * p.element_size() for p in net.parameters())
    x, y = torch.randn(BATCH * STEPS, sizes[0]), torch.randint(0, sizes[-1], (BATCH * STEPS,))
    model = fitdp.Model(net)
    model.compile(optimizer="sgd", lr=0.01, loss="cross_entropy")
    model.fit(x, y, batch_size=BATCH, epochs=1, devices=["cpu"] * replicas, verbose=0)
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KB on Linux
    return {"replicas": replicas, "peak_bytes": peak_kb * 1024, "weights_bytes": weights}


def measure_child(replicas: int, quick: bool) -> dict[str, Any]:
    """``measure`` in a fresh process."""
    cmd = [sys.executable, __file__, "--run", str(replicas), *(["--quick"] if quick else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per count")
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: a 1.3M-parameter MLP, one process per count")
    parser.add_argument("--run", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = QUICK_SIZES if args.quick else SIZES
    if args.run:  # a child: one count's peak, one JSON line
        print(json.dumps(measure(args.run, sizes)))
        return
    repeats = 1 if args.quick else args.repeats
    peaks: dict[int, list[int]] = {}
    weights = 0
    for _ in range(repeats):  # counts interleaved: a drift on the machine hits each alike
        for n in REPLICAS:
            got = measure_child(n, args.quick)
            peaks.setdefault(n, []).append(got["peak_bytes"])
            weights = got["weights_bytes"]
    median = {n: statistics.median(v) for n, v in peaks.items()}
    steps = {f"{n}->{n + 1}": (median[n + 1] - median[n]) / weights for n in REPLICAS[:-1]}
    worst = (median[REPLICAS[-1]] - median[REPLICAS[0]]) / (len(REPLICAS) - 1) / weights
    print(f"MLP {'-'.join(map(str, sizes))}, SGD, batch {BATCH}, {STEPS} steps; weights "
          f"{weights / 2**20:.1f} MiB; median peak RSS of {repeats} fresh process(es)")
    for n in REPLICAS:
        print(f"  {n} replica(s): {median[n] / 2**20:8.1f} MiB  (runs: "
              + ", ".join(f"{p / 2**20:.1f}" for p in peaks[n]) + ")")
    for name, ratio in steps.items():
        print(f"  extra replica {name}: {ratio:.2f}x the weights")
    ok = "ok" if worst <= TARGET else "MISSED"
    print(f"peak memory per extra CPU replica {worst:.2f}x the weights (target <= {TARGET}) {ok}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sizes": sizes, "weights_bytes": weights, "peaks_bytes": peaks,
                       "median_bytes": median, "steps": steps, "per_extra_replica": worst,
                       "target": TARGET, "quick": args.quick}, f, indent=2)


if __name__ == "__main__":
    main()
