"""Two CPU replicas against the hand-written two-thread loop and against one replica; the work
loads; and the memory an extra replica costs.

Run: python bench/replicas.py [--quick] [--repeats 7] [--sections speed,loads,memory] [--json out]

  speed    ``Model.fit(devices=["cpu", "cpu"])`` against ``common.hand_two_threads`` (two
           persistent replicas, the halves of each batch on two threads, gradients added,
           one Adam step, weights copied back) and against ``devices=["cpu"]``: on the MLP
           1024-1024-1024-10 (batch 256) and the MLP 128-128-128-10 (batch 64). Wall clock.
  loads    the second replica at half speed (its thread runs the forward twice):
           ``work_load_list="auto"`` against the equal split.
  memory   peak RSS of a 21M-parameter MLP trained on 1, 2 and 3 CPU replicas, each in a
           fresh process: what one extra replica costs, as a multiple of the weights.
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import statistics
import subprocess
import sys
import threading
from typing import Any

import torch
from common import (
    Results,
    fitdp_loop,
    hand_two_threads,
    interleave,
    mlp,
    ms,
    paired,
    parser,
    pin_threads,
)
from torch import nn

import fitdp

SPEED = [([1024, 1024, 1024, 10], 256, 10), ([128, 128, 128, 10], 64, 200)]
MEMORY_SIZES, QUICK_MEMORY_SIZES = [1024, 4096, 4096, 10], [256, 1024, 1024, 10]


class HalfSpeedOnReplica1(nn.Module):
    """``net``, but on fitdp's second device thread (``fitdp-device-1``) its forward runs
    twice: that replica works at half speed, the update is unchanged (the extra branch counts
    0x). ``slowed`` counts the forwards it slowed (none: the threads are named otherwise)."""

    slowed = 0

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        if threading.current_thread().name != "fitdp-device-1":
            return out
        HalfSpeedOnReplica1.slowed += 1
        return out + 0.0 * self.net(x)


def speed(out: Results, quick: bool, repeats: int) -> None:
    for sizes, bs, steps in SPEED:
        steps = max(2, steps // 5) if quick else steps
        torch.manual_seed(0)
        x, y = torch.randn(bs * steps, sizes[0]), torch.randint(0, 10, (bs * steps,))
        net = mlp(sizes)
        times = interleave({
            "hand": hand_two_threads(copy.deepcopy(net), x, y, bs),
            "two": fitdp_loop(copy.deepcopy(net), x, y, bs, ["cpu", "cpu"]),
            "one": fitdp_loop(copy.deepcopy(net), x, y, bs, ["cpu"]),
        }, steps, repeats, clock="wall")
        name = f"MLP {'-'.join(map(str, sizes))}, batch {bs}"
        out.row("speed", f"{name}: 2 replicas, speed vs the hand 2-thread loop", "hand loop",
                ms(times["hand"]), ms(times["two"]), "ms/step", paired(times, "hand", "two"),
                ">=", 0.95, "ratio: speed, hand time / fitdp time")
        out.row("speed", f"{name}: 2 replicas, speed vs 1 replica", "1 replica",
                ms(times["one"]), ms(times["two"]), "ms/step", paired(times, "one", "two"),
                ">=", 1.4 if sizes[1] >= 1024 else None,
                "ratio: speed-up; the hand 2-thread loop's own speed-up over 1 replica in this "
                f"run (what the machine's two cores give): {paired(times, 'one', 'hand'):.3f}")


def loads(out: Results, quick: bool, repeats: int) -> None:
    sizes, bs, steps = SPEED[0]
    steps = 2 if quick else steps
    x, y = torch.randn(bs * steps, sizes[0]), torch.randint(0, 10, (bs * steps,))
    net = HalfSpeedOnReplica1(mlp(sizes))
    loops = {name: fitdp_loop(copy.deepcopy(net), x, y, bs, ["cpu", "cpu"], work_load_list=w)
             for name, w in (("auto", "auto"), ("equal", None))}
    times = interleave(loops, steps, repeats, clock="wall")
    slowed = HalfSpeedOnReplica1.slowed > 0
    out.row("loads", "MLP 1024^3, replica 1 at half speed: work_load_list='auto', speed-up",
            "equal split", ms(times["equal"]), ms(times["auto"]), "ms/step",
            paired(times, "equal", "auto"), ">=", 1.3 if slowed else None,
            "" if slowed else "no forward was slowed: no thread is named fitdp-device-1")


def peak(replicas: int, sizes: list[int]) -> dict[str, int]:
    """Peak RSS after 4 SGD steps (no optimizer state) on ``replicas`` CPU replicas."""
    pin_threads()
    net = mlp(sizes)
    x, y = torch.randn(64 * 4, sizes[0]), torch.randint(0, 10, (64 * 4,))
    model = fitdp.Model(net)
    model.compile(optimizer="sgd", lr=0.01, loss="cross_entropy")
    model.fit(x, y, batch_size=64, devices=["cpu"] * replicas, verbose=0)
    return {"peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "weights": sum(p.numel() * p.element_size() for p in net.parameters())}


def memory(out: Results, quick: bool, repeats: int) -> None:
    if quick:  # in this process: the code runs, the numbers mean nothing (RSS only grows)
        got = {n: [peak(n, QUICK_MEMORY_SIZES)] for n in (1, 2, 3)}
    else:
        got = {n: [] for n in (1, 2, 3)}
        for _ in range(min(repeats, 3)):  # the counts interleaved: a drift hits each alike
            for n in got:
                proc = subprocess.run([sys.executable, __file__, "--memory-child", str(n)],
                                      capture_output=True, text=True, check=True)
                got[n].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    weights = got[1][0]["weights"]
    median = {n: statistics.median(r["peak"] for r in runs) for n, runs in got.items()}
    out.extra["memory_peak_bytes"] = median
    out.row("memory", "peak RSS per extra CPU replica (MLP 1024-4096-4096-10, SGD)",
            "the weights", weights / 2**20, (median[3] - median[1]) / 2 / 2**20, "MiB", None,
            "<=", 2.3, f"1 -> 2: {(median[2] - median[1]) / weights:.2f}x the weights")


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--sections", default="speed,loads,memory")
    p.add_argument("--memory-child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.memory_child:
        print(json.dumps(peak(args.memory_child, MEMORY_SIZES)))
        return
    pin_threads()
    out = Results("replicas", args)
    repeats = 1 if args.quick else args.repeats
    runs: dict[str, Any] = {"speed": speed, "loads": loads, "memory": memory}
    for name in args.sections.split(","):
        print(f"[{name}]", flush=True)
        runs[name](out, args.quick, repeats)
    out.finish()


if __name__ == "__main__":
    main()
