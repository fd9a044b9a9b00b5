"""What ``EMA`` costs per optimizer step: ``fit`` with and without it on the 784-512-512-10
MLP of bench/overhead.py (batch 256, Adam, one thread), interleaved, medians; and, for scale,
what the same average costs torch's own loop (``AveragedModel.update_parameters`` after each
``optimizer.step()``) in the same run.

Run: python bench/ema_cost.py [--repeats 9] [--steps 30] [--quick]

Each timed ``fit`` is one epoch of ``--steps`` steps, so the per-fit work of EMA (one copy of
the weights when training begins, the swap when it ends) is counted in, spread over them.
Times are this process's CPU time (one thread: time spent waiting for a core on a shared
machine does not count); a ratio is the median of the ratios of the rounds (each round runs
every case once, in turn).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's fitdp
from overhead import hand_loop, mlp  # noqa: E402  (bench/ is sys.path[0])
from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: E402
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn  # noqa: E402

import fitdp  # noqa: E402
from fitdp.callbacks import EMA  # noqa: E402

TARGET = 1.03  # with EMA / without, per step, at most


class TimedEMA(EMA):
    """EMA that adds up the CPU time its per-batch hook takes (the update of each step):
    the part of the cost that machine load does not blur."""

    spent = 0.0

    def on_train_batch_begin(self, batch: int, logs: dict[str, float] | None = None) -> None:
        start = time.process_time()
        super().on_train_batch_begin(batch, logs)
        TimedEMA.spent += time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 repeat, 3 steps")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.steps = 1, 3
    torch.set_num_threads(1)
    torch.manual_seed(0)
    bs = 256
    x, y = torch.randn(bs * args.steps, 784), torch.randint(0, 10, (bs * args.steps,))
    net = mlp([784, 512, 512, 10])
    models = {}
    for name in ("ema", "plain"):
        models[name] = fitdp.Model(copy.deepcopy(net))
        models[name].compile(optimizer="adam", lr=1e-3, loss="cross_entropy")

    def fit(name: str) -> None:
        callbacks = [TimedEMA(decay=0.999)] if name == "ema" else []
        models[name].fit(x, y, batch_size=bs, epochs=1, verbose=0, devices=["cpu"],
                         callbacks=callbacks, shuffle=False)

    hand_net = copy.deepcopy(net)
    hand = hand_loop(hand_net, x, y, bs, "cpu")
    averaged = AveragedModel(hand_net, multi_avg_fn=get_ema_multi_avg_fn(0.999))

    def hand_ema() -> None:
        """torch's loop with the average: update_parameters right after each
        optimizer.step() (a global post-step hook, there for this epoch only)."""
        hook = register_optimizer_step_post_hook(lambda *_: averaged.update_parameters(hand_net))
        try:
            hand()
        finally:
            hook.remove()

    cases = {"fitdp + EMA": lambda: fit("ema"), "fitdp": lambda: fit("plain"),
             "torch loop + AveragedModel": hand_ema, "torch loop": hand}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for run in cases.values():  # warm up
        run()
    TimedEMA.spent = 0.0
    for _ in range(args.repeats):  # interleaved: load changes hit every case alike
        for name, run in cases.items():
            start = time.process_time()
            run()
            times[name].append((time.process_time() - start) / args.steps)
    for name, ts in times.items():
        print(f"{name:<28} {statistics.median(ts) * 1e3:8.3f} ms/step")
    ratios = [statistics.median(a / b for a, b in zip(times[x], times[y]))
              for x, y in (("fitdp + EMA", "fitdp"), ("torch loop + AveragedModel",
                                                       "torch loop"))]
    hooks = TimedEMA.spent / (args.repeats * (args.steps - 1))  # the first batch has none
    step = statistics.median(times["fitdp"])
    print(f"EMA's update inside fit: {hooks * 1e3:.3f} ms/step, {hooks / step:.1%} of a step")
    print(f"torch loop: AveragedModel costs {ratios[1]:.3f}x per step")
    print(f"EMA cost per step: {ratios[0]:.3f}x (target <= {TARGET})")

if __name__ == "__main__":
    main()
