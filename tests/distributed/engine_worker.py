"""One rank of tests/distributed/test_strategy.py's 2-rank job: the DDP and FSDP2 engines, driven
through their interface as the executor drives them (``replicas``, ``bind``, ``prepare``,
``reduce``), sum each rank's row-weighted loss gradients into the whole batch's (5 rows and
3, or 8 and an empty share); then a sharded checkpoint (model and Adam state) written by both
ranks through ``save_sharded``, sync and async, read back with ``load_sharded`` into a fresh
sharded model through the engine's ``copy_into``.

Usage: torchrun ... engine_worker.py OUT_DIR
"""

from __future__ import annotations

import sys
import types

import torch
import torch.distributed as dist
from torch import nn

from fitdp import DDP, FSDP
from fitdp.executor.engine import empty_share
from fitdp.saving.sharded import load_sharded, save_sharded

OUT = sys.argv[1]
CPU = torch.device("cpu")

owned = not dist.is_initialized()  # in tests/conftest.py's shared job it may be made
if owned:
    dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def bound(options):
    """The engine of ``options`` with its one replica of ``net()``, bound as the manager
    binds it (``lead``: what the engine sees of device 0's executor)."""
    engine = options.engine()
    [module] = engine.replicas(net(), [CPU], None)
    lead = types.SimpleNamespace(module=module, device=CPU, fn=module, ranked=None)
    engine.bind(lead, [list(module.parameters())])
    return engine, lead


x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
y = torch.randint(0, 3, (8,), generator=torch.Generator().manual_seed(2))
full = net()
for _ in range(2):  # two accumulated micro-batches
    nn.functional.cross_entropy(full(x), y).backward()
FSDP_OPTIONS = FSDP(min_params=50)
for options, split in ((DDP(), (5, 3)), (DDP(), (8, 0)), (FSDP_OPTIONS, (8, 0)),
                       (FSDP_OPTIONS, (5, 3))):
    lo, rows = (0, split[0]) if rank == 0 else (split[0], split[1])
    engine, lead = bound(options)
    for micro in range(2):  # the first backward accumulates locally, the second syncs
        engine.prepare(micro == 1)
        if rows == 0:  # rank 1's share of the step is empty: it still meets rank 0
            empty_share(lead.ranked, x[:0])
            continue
        out = lead.fn(x[lo:lo + rows])
        (nn.functional.cross_entropy(out, y[lo:lo + rows], reduction="sum") / 8).backward()
    engine.reduce()  # nothing left after a backward that reduced
    module = lead.module
    for (name, p), q in zip(module.named_parameters(), full.parameters()):
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(grad, q.grad, rtol=1e-5, atol=1e-6,
                                   msg=f"{options} {split} {name}")
    engine.close()
    assert lead.fn is module and lead.ranked is (module if options is FSDP_OPTIONS else None)
print("engines ok", flush=True)

# `module` is the FSDP2 model with its gradients: one Adam step, then save its shards.
opt = torch.optim.Adam(module.parameters(), lr=0.01)
opt.step()


def shards() -> dict:
    return {"module": module.state_dict(), "optimizer": opt.state_dict()}


save_sharded(OUT + "/sync", shards(), step=1)
save_sharded(OUT + "/ckpt", shards(), step=1)  # replaced below
save_sharded(OUT + "/ckpt", shards(), step=2, async_save=True).result()  # type: ignore[union-attr]
loaded = load_sharded(OUT + "/ckpt")  # whole tensors, on every rank
fresh, lead = bound(FSDP_OPTIONS)
for name, p in lead.module.named_parameters():
    fresh.copy_into(p, loaded["module"][name])
for a, b in zip(module.parameters(), lead.module.parameters()):
    assert torch.equal(a.to_local(), b.to_local())  # this rank's shard, bitwise
# The whole tensors (gathering is a collective: every rank), for the one-process test.
whole = {"module": {k: v.full_tensor() for k, v in module.state_dict().items()},
         "optimizer": {i: {k: v.full_tensor() for k, v in s.items() if k != "step"}
                       for i, s in opt.state_dict()["state"].items()}}
if rank == 0:
    torch.save(whole, OUT + "/full.pt")
print("sharded checkpoint ok", flush=True)
dist.barrier()
if owned:
    dist.destroy_process_group()
