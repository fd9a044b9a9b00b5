"""fitdp under torchrun against a hand-written DistributedDataParallel loop, on the CPU.

Run: python bench/distributed.py [--quick] [--repeats 5] [--steps 40] [--epochs 4] [--json out]

Each round is one torchrun launch of 2 ranks (gloo on 127.0.0.1, one thread per process) that
trains, one after the other in the same processes (the order rotating from round to round):

  fitdp    ``Model.fit(batch_size=128)`` per rank, ``strategy="auto"`` (DDP across ranks)
  hand     a hand-written ``DistributedDataParallel`` loop, each rank taking its half of every
           pre-shuffled global batch of 256
  fsdp     ``compile(strategy="fsdp")`` (FSDP2): also the bytes each rank's optimizer steps
           (its parameter shards, their gradients, Adam's moments) against ``fitdp``'s
  zero1    ``compile(strategy="zero1")`` (ZeroRedundancyOptimizer): also the bytes of Adam's
           moments each rank holds against ``fitdp``'s (DDP's, whole on every rank)
  hybrid   ``devices=["cpu", "cpu"]`` on each rank: 2 ranks x 2 CPU replicas

and, in a full run, ``local``: one process, ``devices=["cpu", "cpu"]``, batch 256. Every case
trains the MLP 784-512-512-10 with Adam on the same data; rank 0 times every epoch, and the
median over the epochs after the first gives samples/s. A ratio is the median of the rounds'.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
from common import TAG, Results, emit, mlp, parser, pin_threads, synthetic, torchrun
from torch.nn import functional as F

SIZES, GLOBAL_BATCH, WORLD = [784, 512, 512, 10], 256, 2
NAMES = {"fitdp": "fitdp, 2 ranks", "hand": "hand DDP loop, 2 ranks",
         "fsdp": "fitdp strategy='fsdp', 2 ranks", "zero1": "fitdp strategy='zero1', 2 ranks",
         "hybrid": "fitdp, 2 ranks x 2 CPU replicas",
         "local": "fitdp, 1 process, devices=['cpu', 'cpu']"}


def local_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    local = t.to_local() if hasattr(t, "to_local") else t  # FSDP2's DTensor: this rank's shard
    return local.numel() * local.element_size()


def fit(kind: str, x: torch.Tensor, y: torch.Tensor, epochs: int) -> dict[str, Any]:
    import fitdp  # noqa: PLC0415 - in the ranks only: the launcher need not pay for it

    class Probe(fitdp.callbacks.Callback):
        """Each epoch's seconds and last loss; the most bytes the optimizer held after a step
        (``held``), and of them its state's (``state``: under zero1 the sharded optimizer's
        part, the compiled one holding none while the replicas run)."""

        def __init__(self) -> None:
            super().__init__()
            self.seconds: list[float] = []
            self.loss, self.held, self.state = float("nan"), 0, 0

        def on_epoch_begin(self, epoch: int, logs: dict[str, float] | None = None) -> None:
            self.t0 = time.perf_counter()

        def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
            self.seconds.append(time.perf_counter() - self.t0)
            self.loss = (logs or {}).get("loss", float("nan"))

        def on_train_batch_end(self, batch: int, logs: dict[str, float] | None = None) -> None:
            opt = self.model.optimizer
            params = [p for g in opt.param_groups for p in g["params"]]
            zero = getattr(self.model._replicas.engine, "zero", None)
            state = sum(local_bytes(v) for s in (zero.optim if zero else opt).state.values()
                        for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
            held = sum(local_bytes(p) + local_bytes(p.grad) for p in params) + state
            self.held, self.state = max(self.held, held), max(self.state, state)

    model = fitdp.Model(mlp(SIZES))
    model.compile(optimizer="adam", lr=1e-3, loss="cross_entropy",
                  strategy=kind if kind in ("fsdp", "zero1") else "auto")
    probe = Probe()
    devices = ["cpu", "cpu"] if kind in ("hybrid", "local") else ["cpu"]
    batch = GLOBAL_BATCH if kind == "local" else GLOBAL_BATCH // WORLD
    model.fit(x, y, batch_size=batch, epochs=epochs, devices=devices, seed=0, verbose=0,
              callbacks=[probe])
    model.close()
    return {"seconds": probe.seconds, "loss": probe.loss, "held": probe.held,
            "state": probe.state}


def hand(x: torch.Tensor, y: torch.Tensor, epochs: int) -> dict[str, Any]:
    import torch.distributed as dist  # noqa: PLC0415
    from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415

    rank, per = dist.get_rank(), GLOBAL_BATCH // WORLD
    net = DistributedDataParallel(mlp(SIZES))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    seconds, loss = [], torch.zeros(())
    for epoch in range(epochs):
        t0 = time.perf_counter()
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        xs, ys = x[order], y[order]  # one gather per epoch, then views (as fitdp does)
        for start in range(rank * per, len(x), GLOBAL_BATCH):
            opt.zero_grad()
            loss = F.cross_entropy(net(xs[start:start + per]), ys[start:start + per])
            loss.backward()
            opt.step()
        seconds.append(time.perf_counter() - t0)
    del net, opt  # DDP's reducer holds the group: freed here, not at interpreter exit
    return {"seconds": seconds, "loss": float(loss), "held": 0, "state": 0}


def worker(kinds: list[str], steps: int, epochs: int) -> None:
    """Every kind in turn, in this process (a torchrun rank, or alone for ``local``)."""
    import torch.distributed as dist  # noqa: PLC0415

    pin_threads()
    x, y = synthetic(GLOBAL_BATCH * steps, SIZES[0], SIZES[-1])
    ranked = "RANK" in os.environ
    if ranked:
        dist.init_process_group("gloo")
    for kind in kinds:
        got = hand(x, y, epochs) if kind == "hand" else fit(kind, x, y, epochs)
        if not ranked or dist.get_rank() == 0:
            emit({"kind": kind, **got})
    if ranked:
        dist.barrier()
        dist.destroy_process_group()


def main() -> None:
    p = parser(__doc__, repeats=5)
    p.add_argument("--steps", type=int, default=40, help="global batches per epoch")
    p.add_argument("--epochs", type=int, default=4, help="epochs per case (the first warms up)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.repeats, args.steps, args.epochs = 1, 4, 2
    if args.worker:
        worker(args.worker.split(","), args.steps, args.epochs)
        return
    out = Results("distributed", args)
    kinds = ["fitdp", "hand", "fsdp", "zero1", "hybrid"]
    rounds: list[dict[str, dict[str, Any]]] = []
    me = [os.path.abspath(__file__), "--steps", str(args.steps), "--epochs", str(args.epochs)]
    for r in range(args.repeats):
        order = kinds[r % len(kinds):] + kinds[:r % len(kinds)]
        lines = torchrun([*me, "--worker", ",".join(order)], args.timeout)
        if not args.quick:  # one process with two replica threads on the same two cores
            lines += local_run(me, args.timeout)
        rounds.append({line["kind"]: line for line in lines})
        print(f"  round {r + 1}: " + ", ".join(
            f"{k} {samples_per_s(v, args.steps):,.0f} samples/s" for k, v in rounds[-1].items()),
            flush=True)

    def speed(kind: str) -> float:
        return statistics.median(samples_per_s(r[kind], args.steps) for r in rounds)

    for kind in [k for k in rounds[0] if k != "hand"]:
        ratio = statistics.median(samples_per_s(r[kind], args.steps)
                                  / samples_per_s(r["hand"], args.steps) for r in rounds)
        out.row("speed", f"MLP 784-512-512-10, global batch 256: {NAMES[kind]}", NAMES["hand"],
                speed("hand"), speed(kind), "samples/s", ratio, ">=" if kind == "fitdp" else "",
                1.0 if kind == "fitdp" else None, f"final loss {rounds[-1][kind]['loss']:.4f}")
    held = {k: rounds[-1][k]["held"] for k in ("fitdp", "fsdp")}
    out.row("sharding", "bytes the optimizer steps per rank (params, grads, Adam): fsdp",
            "strategy='auto' (DDP)", held["fitdp"] / 2**20, held["fsdp"] / 2**20, "MiB", None,
            "<=", 0.6)
    state = {k: rounds[-1][k]["state"] for k in ("fitdp", "zero1")}
    out.row("sharding", "optimizer state bytes per rank (Adam's moments): zero1",
            "strategy='auto' (DDP)", state["fitdp"] / 2**20, state["zero1"] / 2**20, "MiB", None,
            "<=", 0.6)
    out.extra["rounds"] = rounds
    out.finish()


def samples_per_s(line: dict[str, Any], steps: int) -> float:
    return GLOBAL_BATCH * steps / statistics.median(line["seconds"][1:] or line["seconds"])


def local_run(me: list[str], timeout: float) -> list[dict[str, Any]]:
    """The ``local`` case in a plain process (no torchrun): its tagged line."""
    proc = subprocess.run([sys.executable, *me, "--worker", "local"], capture_output=True,
                          text=True, timeout=timeout, check=True)
    return [json.loads(x[len(TAG):]) for x in proc.stdout.splitlines() if x.startswith(TAG)]


if __name__ == "__main__":
    main()
