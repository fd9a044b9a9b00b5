"""One rank of tests/distributed/test_strategy.py's fit-level job: the same fit under each
strategy and setup, rank 0's weights saved for the test to compare with one process.

Usage: torchrun ... strategy_worker.py OUT_DIR STRATEGY[,STRATEGY...]
("fsdp-blocks": fitdp.FSDP(blocks=(nn.Linear,)), each Linear sharded on its own; "hybrid":
two CPU replicas per rank, fitdp's own flat buckets all-reduced after backward)
"""

from __future__ import annotations

import os
import sys
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import fitdp
from fitdp.call import replicas
from fitdp.executor.local_reduce import LocalReduce

OUT, STRATEGIES = sys.argv[1], sys.argv[2].split(",")
RANK = int(os.environ["RANK"])
torch.set_num_threads(1)
# (name, optimizer, grad_accum_steps, grad_clip_norm, precision): each runs under each strategy
SETUPS = [("sgd", "sgd", 1, None, "32"), ("adamw", "adamw", 2, 0.05, "bf16-mixed"),
          ("adamw32", "adamw", 3, 0.05, "32")]
OPTIONS = {"fsdp-blocks": fitdp.FSDP(blocks=(nn.Linear,))}
chosen: list[str] = []  # the engine of each call's replicas
alive: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # every DDP wrapper fit made
sharded: list[int] = []  # FSDP2: the DTensor parameters of each replica fit sharded
engine_for = replicas.engine_for


def counted(*args, **kwargs):
    engine = engine_for(*args, **kwargs)
    chosen.append(type(engine).__name__)
    if isinstance(engine, LocalReduce):
        engine.bucket_bytes = 512  # three buckets ([w1], [b1, w2], [b2]) of different sizes
    return engine


replicas.engine_for = counted
teardown = dist.destroy_process_group


def destroy(*args, **kwargs):
    """At exit, fitdp tears the process group down: no DDP reducer may be alive then."""
    print(f"rank {RANK} DDP wrappers alive at teardown: {len(alive)}", flush=True)
    teardown(*args, **kwargs)


dist.destroy_process_group = destroy


def data(n: int = 44) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


for strategy in STRATEGIES:
    hybrid = strategy == "hybrid"
    # hybrid: 41 rows, the last global batch 1 row: rank 1's share and rank 0's device 1's
    # are empty, and the epoch's last step (accumulating) is taken after its batches
    x, y = data(41 if hybrid else 44)
    for name, optimizer, accum, clip, precision in SETUPS:
        torch.manual_seed(RANK)  # rank 0's weights must reach every rank
        net = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3))
        model = fitdp.Model(net)
        model.compile(optimizer=optimizer, lr=0.05, loss="cross_entropy",
                      grad_accum_steps=accum, grad_clip_norm=clip, precision=precision,
                      strategy="auto" if hybrid else OPTIONS.get(strategy, strategy))
        # 44 rows, 5 per rank: the last global batch has 4 rows (2 and 2)
        model.fit(x, y, batch_size=5, epochs=2, shuffle=False, verbose=0,
                  devices=["cpu", "cpu"] if hybrid else "auto")
        engine = model._replicas.manager.engine
        if strategy == "ddp":
            alive.add(engine.wrapper)
        elif strategy.startswith("fsdp"):
            lead = model._replicas.manager.execgrp.executors[0].module
            sharded.append(sum(isinstance(p, DTensor) for p in lead.parameters()))
        else:
            assert len(engine.flat.plan) == 3, engine.flat.plan
        if RANK == 0:  # rank 0 alone: fit's end gathered the shards (FSDP2) on every rank
            torch.save(model.get_weights(), os.path.join(OUT, f"{strategy}-{name}.pt"))
        states = [v for st in model._compiled.optimizer.state.values() for v in st.values()]
        if strategy.startswith("fsdp") and name == "adamw32":  # Adam's moments: shards
            print(f"rank {RANK} {strategy} optimizer state in shards: "
                  f"{sum(isinstance(v, DTensor) for v in states)} of {len(states)}", flush=True)
print(f"rank {RANK} engines {sorted(set(chosen))} chosen {len(chosen)} times", flush=True)
print(f"rank {RANK} sharded parameters per replica {sharded}", flush=True)
