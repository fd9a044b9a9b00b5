"""fitdp's per-step overhead against a hand-written loop, and CPU replicas against theirs.

Run: python bench/overhead.py [--repeats 7] [--device cpu|cuda:0] [--json out.json] [--quick]

Each case times, in the same run, ``Model.fit`` and a hand loop over pre-shuffled tensor
slices (same model, data, optimizer and step count, one thread), interleaved, and reports
the median time per step of each and their ratio. Then two-replica scaling, and (CPU) the
cases of bench/replicas.py: two replicas against a hand-written two-thread loop, and
``work_load_list="auto"`` against the equal split with one replica at half speed.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's fitdp
import replicas  # noqa: E402  (bench/ is sys.path[0])

import fitdp  # noqa: E402


def mlp(sizes: list[int]) -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


Loop = Callable[[], None]
TARGETS = {"tiny": 1.05, "wide": 1.01, "custom": 1.05}  # fitdp / reference per step, at most


class OwnStep(fitdp.Model):
    """A subclass with its own train_step (Keras's guide's first example): what a custom
    step costs over the built-in one."""

    def train_step(self, data: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = data
        return self.compute_loss(x, y, self(x, training=True))


def hand_loop(net: nn.Module, x: torch.Tensor, y: torch.Tensor, bs: int, device: str) -> Loop:
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    net.to(device)
    x, y = x.to(device), y.to(device)

    def epoch() -> None:
        perm = torch.randperm(len(x), device=device)
        xs, ys = x[perm], y[perm]
        for i in range(0, len(x), bs):
            opt.zero_grad()
            F.cross_entropy(net(xs[i:i + bs]), ys[i:i + bs]).backward()
            opt.step()

    return epoch


def fitdp_loop(
    net: nn.Module, x: torch.Tensor, y: torch.Tensor, bs: int, devices: list[str],
    cls: type[fitdp.Model] = fitdp.Model,
) -> Loop:
    model = cls(net)
    model.compile(optimizer="adam", lr=1e-3, loss="cross_entropy")
    if devices[0].startswith("cuda"):
        x, y = x.to(devices[0]), y.to(devices[0])

    def epoch() -> None:
        model.fit(x, y, batch_size=bs, epochs=1, devices=devices, verbose=0)

    return epoch


def timed(fn: Loop, sync: bool, clock: Callable[[], float]) -> float:
    if sync:
        torch.cuda.synchronize()
    t = clock()
    fn()
    if sync:
        torch.cuda.synchronize()
    return clock() - t


def compare(name: str, a: Loop, b: Loop, steps: int, repeats: int, sync: bool,
            clock: str = "cpu") -> dict[str, float | str]:
    """Median seconds per step of ``a`` and ``b``, interleaved so noise hits both alike.

    ``clock="cpu"``: this process's CPU time, for single-threaded runs on a shared machine
    (time spent waiting for a core does not count); ``"wall"``: for the multi-thread case.
    """
    tick = time.process_time if clock == "cpu" and not sync else time.perf_counter
    for fn in (a, b):  # warm up
        fn()
    ta, tb = [], []
    for _ in range(repeats):
        ta.append(timed(a, sync, tick) / steps)
        tb.append(timed(b, sync, tick) / steps)
    ma, mb = statistics.median(ta), statistics.median(tb)
    print(f"{name:<46} {ma * 1e3:9.3f} ms  {mb * 1e3:9.3f} ms  ratio {ma / mb:6.3f}  ({clock})")
    return {"a_ms": ma * 1e3, "b_ms": mb * 1e3, "ratio": ma / mb, "clock": clock}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 1 repeat, a fifth of the steps (as replicas.py)")
    args = parser.parse_args()
    if args.quick:
        args.repeats = 1

    def steps(n: int) -> int:  # a quick run checks that each case runs, not its timing
        return max(2, n // 5) if args.quick else n

    torch.set_num_threads(1)
    load = os.getloadavg()
    sync = args.device.startswith("cuda")
    results: dict[str, dict[str, float | str]] = {}
    print(f"{'case (fitdp vs hand loop)':<46} {'fitdp':>12}  {'hand':>12}")
    for name, sizes, bs, n in [
        ("tiny MLP 32-64-64-10, batch 32", [32, 64, 64, 10], 32, 32 * steps(200)),
        ("MLP 784-512-512-10, batch 256", [784, 512, 512, 10], 256, 256 * steps(20)),
    ]:
        torch.manual_seed(0)
        x, y = torch.randn(n, sizes[0]), torch.randint(0, 10, (n,))
        net = mlp(sizes)
        results[name] = compare(
            name, fitdp_loop(copy.deepcopy(net), x, y, bs, [args.device]),
            hand_loop(copy.deepcopy(net), x, y, bs, args.device), n // bs, args.repeats, sync,
        )
    # An overridden train_step against the built-in step, same model and data.
    name = "own train_step / built-in, 784-512-512-10, b256"
    torch.manual_seed(0)
    n, bs = 256 * steps(20), 256
    x, y = torch.randn(n, 784), torch.randint(0, 10, (n,))
    net = mlp([784, 512, 512, 10])
    results["custom"] = compare(
        name, fitdp_loop(copy.deepcopy(net), x, y, bs, [args.device], OwnStep),
        fitdp_loop(copy.deepcopy(net), x, y, bs, [args.device]), n // bs, args.repeats, sync,
    )
    # Scaling: two replicas (one thread each) against one replica, same work.
    torch.manual_seed(0)
    n, bs = 256 * steps(8), 256
    x, y = torch.randn(n, 1024), torch.randint(0, 10, (n,))
    net = mlp([1024, 1024, 1024, 10])
    two = [args.device, args.device]
    name = f"MLP 1024^3, batch 256: 1 replica / {len(two)} replicas"
    results["scaling"] = compare(
        name, fitdp_loop(copy.deepcopy(net), x, y, bs, [args.device]),
        fitdp_loop(copy.deepcopy(net), x, y, bs, two), n // bs, args.repeats, sync, clock="wall",
    )
    out: dict[str, object] = dict(results)
    if args.device == "cpu":
        print()
        out["replicas"] = replicas.run_cases(args.repeats, args.quick)
    out["machine"] = {**replicas.machine(), "loadavg_at_start": load}
    tiny, big = (results[k]["ratio"] for k in list(results)[:2])
    print(f"\ntiny MLP overhead:   {tiny:.3f}x (target <= {TARGETS['tiny']})")
    print(f"784-512-512 overhead: {big:.3f}x (target <= {TARGETS['wide']})")
    print(f"own train_step:       {results['custom']['ratio']:.3f}x the built-in step "
          f"(target <= {TARGETS['custom']})")
    print(f"2-replica speed-up:  {results['scaling']['ratio']:.3f}x (target >= 1.5)")
    print(f"{out['machine']['cpu']}; load average {load} at the start, "
          f"{os.getloadavg()} at the end")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
