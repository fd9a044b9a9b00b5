"""One rank of tests/distributed/test_strategy.py's 2-rank job: DDP and FSDP2 as fitdp wraps
them sum each rank's row-weighted loss gradients into the whole batch's (5 rows and 3, or 8
and an empty share); then
a sharded checkpoint (model and Adam state) written by both ranks, sync and async, read back.

Usage: torchrun ... engine_worker.py OUT_DIR
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

from fitdp.executor import sharded_io
from fitdp.executor.engines import DDP, FSDP, empty_share, set_sync, shard_fsdp, wrap_ddp

OUT = sys.argv[1]

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
y = torch.randint(0, 3, (8,), generator=torch.Generator().manual_seed(2))
full = net()
for _ in range(2):  # two accumulated micro-batches
    nn.functional.cross_entropy(full(x), y).backward()
for kind, split in (("ddp", (5, 3)), ("ddp", (8, 0)), ("fsdp", (8, 0)), ("fsdp", (5, 3))):
    lo, rows = (0, split[0]) if rank == 0 else (split[0], split[1])
    module = net()
    wrapped = wrap_ddp(module, torch.device("cpu"), DDP()) if kind == "ddp" else module
    if kind == "fsdp":
        shard_fsdp(module, FSDP(min_params=50), None)
    for micro in range(2):  # the first backward accumulates locally, the second syncs
        set_sync(wrapped, micro == 1)
        if rows == 0:  # rank 1's share of the step is empty: it still meets rank 0
            empty_share(wrapped, x[:0])
            continue
        out = wrapped(x[lo:lo + rows])
        (nn.functional.cross_entropy(out, y[lo:lo + rows], reduction="sum") / 8).backward()
    for (name, p), q in zip(module.named_parameters(), full.parameters()):
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(grad, q.grad, rtol=1e-5, atol=1e-6,
                                   msg=f"{kind} {split} {name}")
    if kind == "ddp":
        del wrapped
print("engines ok", flush=True)

# `module` is the FSDP2 model with its gradients: one Adam step, then save its shards.
opt = torch.optim.Adam(module.parameters(), lr=0.01)
opt.step()
sharded_io.save(OUT + "/sync", 1, sharded_io.sharded_state(module, opt))
sharded_io.save(OUT + "/ckpt", 1, sharded_io.sharded_state(module, opt))  # replaced below
sharded_io.save(OUT + "/ckpt", 2, sharded_io.sharded_state(module, opt),
                async_save=True).result()  # type: ignore[union-attr]
fresh = net()
shard_fsdp(fresh, FSDP(min_params=50), None)
fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
fresh(x).sum().backward()
fresh_opt.step()  # Adam state exists, with other values
fresh_opt.zero_grad()
state = sharded_io.sharded_state(fresh, fresh_opt)
assert sharded_io.load(OUT + "/ckpt", state) == 2
sharded_io.load_sharded_state(fresh, fresh_opt, state)
for a, b in zip(module.parameters(), fresh.parameters()):
    assert torch.equal(a.to_local(), b.to_local())  # this rank's shard, bitwise
for sa, sb in zip(opt.state.values(), fresh_opt.state.values()):
    assert all(torch.equal(sa[k].to_local() if hasattr(sa[k], "to_local") else sa[k],
                           sb[k].to_local() if hasattr(sb[k], "to_local") else sb[k])
               for k in sa)
full = sharded_io.full_state(module)
if rank == 0:
    torch.save({k: v.clone() for k, v in full.items()}, OUT + "/full.pt")
print("sharded checkpoint ok", flush=True)
dist.barrier()
dist.destroy_process_group()
