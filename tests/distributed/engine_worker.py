"""One rank of tests/distributed/test_strategy.py's 2-rank job: DDP and FSDP2 as fitdp wraps
them sum each rank's row-weighted loss gradients into the whole batch's (5 rows and 3)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fitdp.executor.engines import DDP, FSDP, no_sync, shard_fsdp, wrap_ddp

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
lo, rows = (0, 5) if rank == 0 else (5, 3)
for kind in ("ddp", "fsdp"):
    module = net()
    wrapped = wrap_ddp(module, torch.device("cpu"), DDP()) if kind == "ddp" else module
    if kind == "fsdp":
        shard_fsdp(module, FSDP(min_params=50), None)
    for micro in range(2):  # the first backward accumulates locally, the second syncs
        with no_sync(wrapped, syncing=micro == 1):
            out = wrapped(x[lo:lo + rows])
            (nn.functional.cross_entropy(out, y[lo:lo + rows], reduction="sum") / 8).backward()
    for (name, p), q in zip(module.named_parameters(), full.parameters()):
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(grad, q.grad, rtol=1e-5, atol=1e-6, msg=f"{kind} {name}")
    del wrapped, module
print("engines ok", flush=True)
dist.barrier()
dist.destroy_process_group()
