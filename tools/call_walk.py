"""Count the fitdp functions and files one steady-state training batch enters.

The case of issue 30: two CPU replicas, Adam, one torchmetrics metric
(``MulticlassAccuracy``), in-memory tensors, a small MLP. A profiler on every thread
(``sys.setprofile`` and ``threading.setprofile``, installed before the fit starts its replica
threads) is armed from the optimizer step of batch ``WARM`` to that of batch ``WARM + 1`` (a
global optimizer step hook: no callback, so the fit reads no batch logs it would not read
anyway), so what it records is one whole batch cycle after the first ones: the end of one
step, the loop's next batch, its load, forward, backward, metric, reduce and step.

Run: ``python tools/call_walk.py`` (``--list`` prints every function).
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torchmetrics.classification import MulticlassAccuracy

import fitdp

ROOT = Path(fitdp.__file__).resolve().parent
WARM = 24  # batches before the one recorded: the first batches check and decide things


def walk() -> set[str]:
    """``file:function`` of every fitdp function one steady-state batch enters."""
    called: set[str] = set()
    armed = [False]

    def profile(frame, event, arg):  # noqa: ANN001, ANN202 - sys.setprofile's signature
        if event == "call" and armed[0]:
            path = Path(frame.f_code.co_filename)
            if ROOT in path.parents:
                name = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
                called.add(f"{path.relative_to(ROOT).as_posix()}:{name}")

    steps = [0]

    def arm(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        steps[0] += 1
        armed[0] = steps[0] == WARM

    torch.manual_seed(0)
    model = fitdp.Model(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    model.compile(optimizer="adam", loss="cross_entropy",
                  metrics=[MulticlassAccuracy(num_classes=4)])
    x, y = torch.randn(32 * (WARM + 4), 16), torch.randint(0, 4, (32 * (WARM + 4),))
    hook = register_optimizer_step_post_hook(arm)
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        model.fit(x, y, batch_size=32, epochs=1, devices=["cpu", "cpu"], verbose=0)
    finally:
        hook.remove()
        sys.setprofile(None)
        threading.setprofile(None)
        model.close()
    return called


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print every function")
    args = parser.parse_args()
    called = walk()
    files = sorted({c.split(":")[0] for c in called})
    print(f"{len(called)} functions in {len(files)} files")
    if args.list:
        for f in files:
            names = sorted(c.split(":", 1)[1] for c in called if c.startswith(f + ":"))
            print(f"  {f} ({len(names)}): {', '.join(names)}")


if __name__ == "__main__":
    main()
