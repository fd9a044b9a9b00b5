"""Flat buckets of parameters and gradients, and their all-reduce across ranks.

The sums across this process's devices and the copies back are the ``Update``'s
(``fitdp.executor.update``), one range per shard; ``reduce_global`` is the manager's default
cross-rank reduction (``manager.cross_rank``).
"""

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
    broadcasting parameters is one call per bucket range, not one per parameter. Backward
    accumulates straight into the views (autograd adds in place into an existing ``.grad``).

    Args:
        params: ``params[d][k]`` is the k-th trainable parameter on device d (same order on
            every device).
        bucket_bytes: target size of one bucket.

    Example:
        >>> a, b = nn.Linear(3, 2), nn.Linear(3, 2)
        >>> fb = FlatBuckets([list(a.parameters()), list(b.parameters())])
        >>> [len(flats) for flats in fb.grad_flat]  # one bucket per device
        [1, 1]
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

    def zero_device(self, d: int) -> None:
        """Zero device ``d``'s gradient buckets (on its own thread, before its backward),
        re-binding first any ``.grad`` that was replaced or cleared."""
        for p, v in zip(self.params[d], self.grad_views[d]):
            if p.grad is not v:
                p.grad = v
        for g in self.grad_flat[d]:
            g.zero_()

    def reduce_global(self, group: dist.ProcessGroup | None = None) -> None:
        """All-reduce (sum) device 0's gradient buckets across the ranks of ``group``."""
        # Synchronous calls: gloo threads left holding async works can abort the interpreter
        # at exit, and with a few large buckets there is little to overlap anyway.
        for g in self.grad_flat[0]:
            dist.all_reduce(g, group=group)
