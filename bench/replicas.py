"""Two CPU replicas against the hand-written limit, and ``work_load_list="auto"``.

Run: python bench/replicas.py [--repeats 7] [--json out.json] [--quick]
(bench/overhead.py runs the same cases and adds them to its JSON.)

* hand vs fitdp: the limit of "one persistent replica per device, one thread each" is a
  hand-written loop doing exactly that: split the batch, forward/backward the halves in two
  threads (the main thread and one pool thread), add the gradients, step Adam, copy the
  weights back. Against it, ``Model.fit(devices=["cpu", "cpu"])`` on the same model, data
  and steps; and ``Model.fit`` on one replica, for the slow-replicas warning.
* auto vs equal: the second replica runs at half speed (it does its forward and backward
  twice); ``work_load_list="auto"`` against the equal split, same model and data.

Wall clock (several threads), one intra-op thread (``torch.set_num_threads(1)``), warm-up
first, the loops interleaved round by round, medians per step.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's fitdp
import fitdp  # noqa: E402

Loop = Callable[[], None]
SIZES = [  # name, layer sizes, batch, steps per fit call (full run)
    ("MLP 1024-1024-1024-10, batch 256", [1024, 1024, 1024, 10], 256, 10),
    ("MLP 128-128-128-10, batch 64", [128, 128, 128, 10], 64, 200),
]
AUTO_CASE = ("MLP 1024-1024-1024-10, batch 256, replica 1 at half speed",
             [1024, 1024, 1024, 10], 256, 10)


def mlp(sizes: list[int]) -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class HalfSpeedOnReplica1(nn.Module):
    """``net``, but on fitdp's device-1 thread it runs forward (and so backward) twice: that
    replica works at half speed, and the update is unchanged (the extra branch counts 0x)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        if threading.current_thread().name == "fitdp-device-1":
            out = out + 0.0 * self.net(x)
        return out


def hand_two_threads(net: nn.Module, x: torch.Tensor, y: torch.Tensor, bs: int) -> Loop:
    """The hand-written limit: two persistent replicas, the halves on two threads."""
    nets = [net, copy.deepcopy(net)]
    params = [list(n.parameters()) for n in nets]
    opt = torch.optim.Adam(params[0], lr=1e-3)
    pool = ThreadPoolExecutor(1)

    def half(k: int, xb: torch.Tensor, yb: torch.Tensor, weight: float) -> None:
        (F.cross_entropy(nets[k](xb), yb) * weight).backward()

    def epoch() -> None:
        perm = torch.randperm(len(x))
        xs, ys = x[perm], y[perm]
        for i in range(0, len(x), bs):
            xb, yb = xs[i:i + bs], ys[i:i + bs]
            h = len(xb) // 2
            for p in params[0] + params[1]:
                p.grad = None
            other = pool.submit(half, 1, xb[h:], yb[h:], (len(xb) - h) / len(xb))
            half(0, xb[:h], yb[:h], h / len(xb))
            other.result()
            for a, b in zip(*params):
                a.grad.add_(b.grad)
            opt.step()
            with torch.no_grad():
                for a, b in zip(*params):
                    b.copy_(a)

    return epoch


def fitdp_epoch(net: nn.Module, x: torch.Tensor, y: torch.Tensor, bs: int, devices: list[str],
                work_load_list: list[float] | str | None = None) -> Loop:
    model = fitdp.Model(net)
    model.compile(optimizer="adam", lr=1e-3, loss="cross_entropy")

    def epoch() -> None:
        model.fit(x, y, batch_size=bs, epochs=1, devices=devices,
                  work_load_list=work_load_list, verbose=0)

    return epoch


def interleaved(loops: dict[str, Loop], steps: int, repeats: int) -> dict[str, list[float]]:
    """Seconds per step of every loop, per round (after one warm-up round)."""
    for fn in loops.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in loops}
    for _ in range(repeats):
        for name, fn in loops.items():
            t = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t) / steps)
    return times


def data(sizes: list[int], rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(rows, sizes[0]), torch.randint(0, sizes[-1], (rows,))


def hand_case(sizes: list[int], bs: int, steps: int, repeats: int) -> dict[str, object]:
    x, y = data(sizes, bs * steps)
    net = mlp(sizes)
    times = interleaved({
        "hand": hand_two_threads(copy.deepcopy(net), x, y, bs),
        "fitdp": fitdp_epoch(copy.deepcopy(net), x, y, bs, ["cpu", "cpu"]),
        "one": fitdp_epoch(copy.deepcopy(net), x, y, bs, ["cpu"]),
    }, steps, repeats)
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {"hand_ms": ms["hand"], "fitdp_ms": ms["fitdp"], "one_replica_ms": ms["one"],
            "speed_ratio": ms["hand"] / ms["fitdp"],
            "rounds_ms": {k: [round(t * 1e3, 3) for t in v] for k, v in times.items()}}


def auto_case(sizes: list[int], bs: int, steps: int, repeats: int) -> dict[str, object]:
    x, y = data(sizes, bs * steps)
    net = HalfSpeedOnReplica1(mlp(sizes))
    models: dict[str, fitdp.Model] = {}
    loops = {}
    for name, loads in (("equal", None), ("auto", "auto")):
        model = models[name] = fitdp.Model(copy.deepcopy(net))
        model.compile(optimizer="adam", lr=1e-3, loss="cross_entropy")
        loops[name] = (lambda m, w: lambda: m.fit(x, y, batch_size=bs, epochs=1,
                                                 devices=["cpu", "cpu"], work_load_list=w,
                                                 verbose=0))(model, loads)
    times = interleaved(loops, steps, repeats)
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    loads = getattr(models["auto"], "work_load_list", None)
    return {"equal_ms": ms["equal"], "auto_ms": ms["auto"],
            "throughput_ratio": ms["equal"] / ms["auto"],
            "auto_loads": [round(w, 3) for w in loads] if loads else None,
            "rounds_ms": {k: [round(t * 1e3, 3) for t in v] for k, v in times.items()}}


def machine() -> dict[str, object]:
    cpu = "unknown"
    with open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    return {"cpu": cpu, "cores": os.cpu_count(), "loadavg": os.getloadavg(),
            "torch": torch.__version__}


def run_cases(repeats: int, quick: bool) -> dict[str, dict[str, object]]:
    """Every case, printed as it ends; steps per fit call are cut to a fifth under quick."""
    torch.set_num_threads(1)
    out: dict[str, dict[str, object]] = {}
    print(f"{'2 CPU replicas (hand vs fitdp), wall ms/step':<46} {'hand':>9} {'fitdp':>9} "
          f"{'1 replica':>9}  fitdp/hand speed")
    for name, sizes, bs, steps in SIZES:
        r = out[name] = hand_case(sizes, bs, max(2, steps // 5) if quick else steps, repeats)
        print(f"{name:<46} {r['hand_ms']:9.3f} {r['fitdp_ms']:9.3f} {r['one_replica_ms']:9.3f}"
              f"  {r['speed_ratio']:.3f} (target >= 0.95)")
    name, sizes, bs, steps = AUTO_CASE
    r = out["auto"] = auto_case(sizes, bs, max(2, steps // 5) if quick else steps, repeats)
    print(f"{name}: equal split {r['equal_ms']:.3f} ms/step, auto {r['auto_ms']:.3f} "
          f"(loads {r['auto_loads']}): {r['throughput_ratio']:.3f}x (target >= 1.3)")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 repeat")
    args = parser.parse_args()
    info = machine()
    print(f"{info['cpu']}, {info['cores']} cores, load average {info['loadavg']}")
    results = {"machine": info, "cases": run_cases(1 if args.quick else args.repeats,
                                                   args.quick)}
    results["machine"]["loadavg_after"] = os.getloadavg()  # type: ignore[index]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
