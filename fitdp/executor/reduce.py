"""Gradient reduction in flat buckets: local (across this process's devices), then global."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

BUCKET_BYTES = 25 * 1024 * 1024


class FlatBuckets:
    """Flat per-device storage for the trainable parameters and their gradients.

    Every replica's parameters and gradients become views into a few large flat tensors
    ("buckets", grouped by dtype, about ``bucket_bytes`` each), so reducing gradients and
    broadcasting parameters is one call per bucket, not one per parameter. Backward
    accumulates straight into the views (autograd adds in place into an existing ``.grad``).

    Args:
        params: ``params[d][k]`` is the k-th trainable parameter on device d (same order on
            every device).
        bucket_bytes: target size of one bucket.

    Example:
        >>> a, b = nn.Linear(3, 2), nn.Linear(3, 2)
        >>> fb = FlatBuckets([list(a.parameters()), list(b.parameters())])
        >>> fb.broadcast_params(); torch.equal(a.weight, b.weight)
        True
    """

    def __init__(self, params: Sequence[Sequence[nn.Parameter]], bucket_bytes: int = BUCKET_BYTES):
        self.params = [list(p) for p in params]
        plan: list[list[int]] = []
        size = 0
        master = self.params[0]
        for k, p in enumerate(master):
            if not plan or master[plan[-1][0]].dtype != p.dtype or size >= bucket_bytes:
                plan.append([])
                size = 0
            plan[-1].append(k)
            size += p.numel() * p.element_size()
        self.plan = plan
        self.param_flat: list[list[torch.Tensor]] = []
        self.grad_flat: list[list[torch.Tensor]] = []
        for dev_params in self.params:
            pf, gf = [], []
            for ks in plan:
                first = dev_params[ks[0]]
                total = sum(dev_params[k].numel() for k in ks)
                pflat = torch.empty(total, dtype=first.dtype, device=first.device)
                gflat = torch.zeros(total, dtype=first.dtype, device=first.device)
                offset = 0
                for k in ks:
                    p = dev_params[k]
                    n = p.numel()
                    pflat[offset : offset + n].copy_(p.detach().reshape(-1))
                    p.data = pflat[offset : offset + n].view_as(p)
                    p.grad = gflat[offset : offset + n].view_as(p)
                    offset += n
                pf.append(pflat)
                gf.append(gflat)
            self.param_flat.append(pf)
            self.grad_flat.append(gf)
        self.grad_views = [[p.grad for p in dev_params] for dev_params in self.params]

    def zero_grad(self) -> None:
        """Zero every gradient bucket, re-binding any ``.grad`` that was replaced or cleared."""
        for dev_params, views in zip(self.params, self.grad_views):
            for p, v in zip(dev_params, views):
                if p.grad is not v:
                    p.grad = v
        for flats in self.grad_flat:
            for g in flats:
                g.zero_()

    def zero_device(self, d: int) -> None:
        """Zero device ``d``'s gradient buckets (on its own thread, before its backward),
        re-binding first any ``.grad`` that was replaced or cleared."""
        for p, v in zip(self.params[d], self.grad_views[d]):
            if p.grad is not v:
                p.grad = v
        for g in self.grad_flat[d]:
            g.zero_()

    def reduce_local(self) -> None:
        """Move every device's gradient buckets into device 0's: add, then zero the source,
        so each backward is counted once however often backward and reduce are called
        between two ``zero_grad`` (the seed's gradients accumulate the same way)."""
        for d in range(1, len(self.grad_flat)):
            for acc, g in zip(self.grad_flat[0], self.grad_flat[d]):
                acc.add_(g.to(acc.device, non_blocking=True))
                g.zero_()

    def reduce_global(self, group: dist.ProcessGroup | None) -> None:
        """All-reduce (sum) device 0's gradient buckets across the ranks of ``group``."""
        # Synchronous calls: gloo threads left holding async works can abort the interpreter
        # at exit, and with a few large buckets there is little to overlap anyway.
        for g in self.grad_flat[0]:
            dist.all_reduce(g, group=group)

    def broadcast_params(self) -> None:
        """Copy device 0's parameter buckets into every other device's."""
        for d in range(1, len(self.param_flat)):
            for dst, src in zip(self.param_flat[d], self.param_flat[0]):
                dst.copy_(src, non_blocking=True)
