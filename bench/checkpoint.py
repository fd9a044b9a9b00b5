"""Checkpoints: what a save costs against torch's own, and what an asynchronous save costs the
training around it.

Run: python bench/checkpoint.py [--quick] [--repeats 7] [--paths one,ddp,fsdp] [--json out]

  save    ``model.save(path)`` (atomic: temporary file, fsync, rename, folder fsync) of an MLP
          4096-4096-2048 (25.2M parameters) with Adam's state against ``torch.save`` of its
          ``{"module", "optimizer"}`` state dicts + fsync, and against a bare ``torch.save``;
          interleaved, ``os.sync()`` before each save, each to a new file.
  stall   inside one ``Model.fit``, rounds of three blocks of K steps in a rotating order: K
          steps alone, K steps after ``model.save(path, async_save=True)`` (then
          ``wait_for_saves``), ``model.save(path)`` then K steps. Per round, lost = async -
          alone and cost = sync - alone (blocks that ran back to back); the ratio is median
          lost / median cost. In one process and, in a full run, under torchrun (2 ranks)
          with ``"ddp"`` and ``"fsdp"`` (a folder of shards).
  copy    ``DataParallelExecutorManager(module, ["cpu", "cpu"]).copy_to`` (the average of two
          replicas into host tensors) against a memcpy: bandwidth, bytes read + written.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import torch
from common import Results, emit, mlp, parser, pin_threads, synthetic, torchrun

import fitdp
from fitdp.executor import DataParallelExecutorManager

FULL, QUICK = [4096, 4096, 2048], [256, 256, 64]
KINDS = ("none", "async", "sync")


def trained(sizes: list[int], strategy: str = "auto") -> fitdp.Model:
    model = fitdp.Model(mlp(sizes))
    model.compile(optimizer="adam", lr=1e-4, loss="cross_entropy", strategy=strategy)
    return model


def save(out: Results, sizes: list[int], repeats: int) -> None:
    model = trained(sizes)
    x, y = synthetic(32, sizes[0], sizes[-1])
    model.fit(x, y, batch_size=32, verbose=0)  # Adam's state exists after a step
    state = {"module": model.module.state_dict(), "optimizer": model.optimizer.state_dict()}

    def fsynced(path: str) -> None:
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    cases = {"fitdp": model.save, "fsync": fsynced, "bare": lambda p: torch.save(state, p)}
    times: dict[str, list[float]] = {k: [] for k in cases}
    with tempfile.TemporaryDirectory(prefix="fitdp-bench-") as folder:
        names = list(cases)
        for r in range(repeats + 1):  # round 0 warms up
            for name in names[r % 3:] + names[:r % 3]:
                path = os.path.join(folder, f"{name}.ckpt")
                os.sync()  # no earlier write-back lands in this save's time
                t = time.perf_counter()
                cases[name](path)
                if r:
                    times[name].append(time.perf_counter() - t)
                size = os.path.getsize(path)
                os.remove(path)
    for ref, label in (("fsync", "torch.save + fsync"), ("bare", "bare torch.save")):
        out.row("save", f"model.save, {size / 1e6:.0f} MB (MLP + Adam)", label,
                statistics.median(times[ref]) * 1e3, statistics.median(times["fitdp"]) * 1e3,
                "ms", statistics.median(a / b for a, b in zip(times["fitdp"], times[ref])),
                "<=" if ref == "fsync" else "", 1.05 if ref == "fsync" else None)


def blocks(sizes: list[int], rounds: int, steps: int, folder: str, strategy: str
           ) -> dict[str, Any]:
    """One fit of (rounds + 1) x 3 blocks of ``steps`` steps; each block's seconds."""
    order = [k for r in range(rounds + 1) for k in KINDS[r % 3:] + KINDS[:r % 3]]
    path = os.path.join(folder, "stall")

    class Blocks(fitdp.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.seconds: list[float] = []
            self.steps = 0

        def start(self) -> None:
            os.sync()
            self.t0 = time.perf_counter()
            if order[len(self.seconds)] != "none":
                self.model.save(path, async_save=order[len(self.seconds)] == "async")

        def on_train_begin(self, logs: dict[str, float] | None = None) -> None:
            self.start()

        def on_train_batch_end(self, batch: int, logs: dict[str, float] | None = None) -> None:
            self.steps += 1
            if self.steps % steps or len(self.seconds) == len(order):
                return
            self.model.wait_for_saves()
            self.seconds.append(time.perf_counter() - self.t0)
            if len(self.seconds) < len(order):
                self.start()

    ranks = 2 if strategy != "auto" else 1
    x, y = synthetic(steps * len(order) * ranks * 32, sizes[0], sizes[-1])
    model = trained(sizes, strategy)
    probe = Blocks()
    model.fit(x, y, batch_size=32, shuffle=False, verbose=0, callbacks=[probe])
    model.close()
    return {"blocks": order, "seconds": probe.seconds}


def analyse(raw: dict[str, Any]) -> dict[str, Any]:
    """Paired differences per round (round 0, the warm-up, left out) and their ratio."""
    per: dict[str, list[float]] = {k: [] for k in KINDS}
    for kind, s in list(zip(raw["blocks"], raw["seconds"]))[len(KINDS):]:
        per[kind].append(s)
    lost = [a - n for a, n in zip(per["async"], per["none"])]
    cost = [s - n for s, n in zip(per["sync"], per["none"])]
    return {"lost_s": lost, "cost_s": cost,
            "ratio": statistics.median(lost) / statistics.median(cost)}


def stall(out: Results, sizes: list[int], rounds: int, paths: list[str], timeout: float
          ) -> None:
    for where in paths:
        with tempfile.TemporaryDirectory(prefix="fitdp-stall-") as folder:
            if where == "one":
                raw = blocks(sizes, rounds, 4, folder, "auto")
            else:
                raw = torchrun([os.path.abspath(__file__), "--worker", where, "--rounds",
                                str(rounds), "--dir", folder, "--sizes",
                                ",".join(map(str, sizes))], timeout)[0]
        res = analyse(raw)
        out.extra[f"stall_{where}"] = {**raw, **res}
        out.row("stall", f"training time an async save costs, {where}", "a sync save's",
                statistics.median(res["cost_s"]) * 1e3, statistics.median(res["lost_s"]) * 1e3,
                "ms", res["ratio"], "<=", 0.10)


def copy(out: Results, sizes: list[int], repeats: int) -> None:
    module = mlp(sizes)
    arg = {n: torch.zeros_like(p) for n, p in module.named_parameters()}
    aux = {n: torch.zeros_like(b) for n, b in module.named_buffers()}
    weights = sum(t.numel() * t.element_size() for t in arg.values())
    src = torch.ones(max(weights, 8 << 20) // 4)
    dst = torch.zeros_like(src)
    mgr = DataParallelExecutorManager(module, ["cpu", "cpu"])
    try:
        def bandwidth(fn: Any, nbytes: int) -> float:
            fn()  # touches every page of the destination
            seconds = []
            for _ in range(repeats):
                t = time.perf_counter()
                fn()
                seconds.append(time.perf_counter() - t)
            return nbytes / statistics.median(seconds) / 1e9

        copy_gbs = bandwidth(lambda: mgr.copy_to(arg, aux), 3 * weights)  # reads 2, writes 1
        mem_gbs = bandwidth(lambda: dst.copy_(src), 2 * src.nbytes)
        for name, p in module.named_parameters():  # the replicas started equal
            torch.testing.assert_close(arg[name], p.detach())
    finally:
        mgr.close()
    out.row("copy", "copy_to from 2 CPU replicas to the host", "memcpy", mem_gbs, copy_gbs,
            "GB/s", None, ">=", 0.5, "ratio: bandwidth")


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=8, help="rounds of the stall")
    p.add_argument("--paths", default=None, help="the stall's: one, ddp, fsdp (default all)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per torchrun job")
    p.add_argument("--worker", choices=("ddp", "fsdp"), help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--sizes", help=argparse.SUPPRESS)
    args = p.parse_args()
    pin_threads()
    if args.worker:  # a torchrun rank of the stall: every rank saves, rank 0 reports
        raw = blocks([int(s) for s in args.sizes.split(",")], args.rounds, 4, args.dir,
                     args.worker)
        if int(os.environ["RANK"]) == 0:
            emit(raw)
        return
    sizes = QUICK if args.quick else FULL
    repeats, rounds = (2, 2) if args.quick else (args.repeats, args.rounds)
    paths = (args.paths or ("one" if args.quick else "one,ddp,fsdp")).split(",")
    out = Results("checkpoint", args)
    print("[save]", flush=True)
    save(out, sizes, repeats)
    print("[stall]", flush=True)
    stall(out, sizes, rounds, paths, args.timeout)
    print("[copy]", flush=True)
    copy(out, sizes, repeats)
    out.finish()


if __name__ == "__main__":
    main()
