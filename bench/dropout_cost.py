"""What reproducible dropout costs on CPU replicas: forwards in device order against
concurrent ones (the race the in-turn order prevents), same model, data and steps.

Run: python bench/dropout_cost.py
"""

import statistics
import time

import torch
from torch import nn

import fitdp
from fitdp.executor.group import DataParallelExecutorGroup

torch.set_num_threads(1)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Dropout(0.1),
                         nn.Linear(1024, 1024), nn.ReLU(), nn.Dropout(0.1), nn.Linear(1024, 10))


X, Y = torch.randn(256 * 8, 1024), torch.randint(0, 10, (256 * 8,))
IN_TURN = DataParallelExecutorGroup._draws_in_turn


def ms_per_step(in_turn: bool) -> float:
    """One warm-up epoch, then two timed ones (16 steps)."""
    DataParallelExecutorGroup._draws_in_turn = IN_TURN if in_turn else (  # type: ignore
        lambda self: False)
    model = fitdp.Model(net())
    model.compile("adam")
    model.fit(X, Y, batch_size=256, devices=["cpu", "cpu"], verbose=0)
    start = time.perf_counter()
    model.fit(X, Y, batch_size=256, epochs=2, devices=["cpu", "cpu"], verbose=0)
    return (time.perf_counter() - start) / 16 * 1e3


def main() -> None:
    runs: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(5):  # interleaved: load changes hit both alike
        for in_turn in (True, False):
            runs[in_turn].append(ms_per_step(in_turn))
    DataParallelExecutorGroup._draws_in_turn = IN_TURN  # type: ignore[method-assign]
    a, b = statistics.median(runs[True]), statistics.median(runs[False])
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"in turn {a:.1f} ms/step, concurrent {b:.1f} ms/step, cost {a / b:.3f}x "
          f"(load average {load})")


if __name__ == "__main__":
    main()
