"""The main job: a small CNN on the 8x8 handwritten digits, data-parallel over two replicas.

Run:  python examples/train_digits.py            (about 20 s on 2 CPU cores)
      python examples/train_digits.py --fast     (a few seconds: the test suite's setting)
      torchrun --nproc-per-node 2 examples/train_digits.py   (two processes, see docs)
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

import fitdp
from fitdp.datasets import load_digits


def make_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.MaxPool2d(2),                      # 8x8 -> 4x4
        nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Dropout(0.2), nn.Linear(128, 10),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--fast", action="store_true", help="2 epochs: a smoke test")
    parser.add_argument("--plot", default=None, help="save loss/accuracy curves to this PNG")
    args = parser.parse_args()
    epochs = 2 if args.fast else args.epochs

    torch.manual_seed(0)
    x, y = load_digits()
    perm = torch.randperm(len(x))
    x, y = x[perm], y[perm]                   # validation_split takes the last 20%
    # Every GPU when there are any; else two CPU replicas, one core each, when this process
    # may use two cores (on one core two replicas would only take turns).
    gpus = torch.cuda.device_count()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    devices = list(range(gpus)) if gpus else ["cpu", "cpu"] if (cores or 1) >= 2 else ["cpu"]
    if os.environ.get("WORLD_SIZE", "1") != "1":
        devices = "auto"                      # under torchrun: one device per process
    elif not gpus:
        torch.set_num_threads(1)

    model = fitdp.Model(make_net())
    model.compile(
        optimizer="adamw", lr=2e-3, loss="cross_entropy",
        metrics=[MulticlassAccuracy(num_classes=10)],
    )
    start = time.perf_counter()
    history = model.fit(
        x, y, epochs=epochs, batch_size=args.batch_size, devices=devices,
        validation_split=0.2, seed=0,
    )
    seconds = time.perf_counter() - start
    if model.is_main_process:
        final = {k: round(v[-1], 4) for k, v in history.history.items()}
        print(f"final metrics after {epochs} epochs ({seconds:.1f} s on {devices}, {cores} usable "
              f"CPU cores): {final}")
        if args.plot:
            history.plot(args.plot)
            print(f"saved curves to {args.plot}")


if __name__ == "__main__":
    main()
