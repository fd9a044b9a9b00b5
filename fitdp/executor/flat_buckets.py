"""Flat buckets of parameters and gradients (fitdp's own engine's storage, ``LocalReduce``).

The sums across this process's devices and the copies back are the ``Update``'s
(``fitdp.executor.update``), one range per shard; ``LocalReduce.reduce`` all-reduces device
0's gradient buckets across the ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket size


class FlatBuckets:
    """Flat per-device storage for the trainable parameters and their gradients.

    Every replica's parameters and gradients become views into a few large flat tensors
    ("buckets", grouped by dtype, about ``bucket_bytes`` each), so reducing gradients and
    broadcasting parameters is one call per bucket range, not one per parameter. Backward
    accumulates straight into the views (autograd adds in place into an existing ``.grad``).

    Each weight is written once, into its bucket, and the parameter's old storage is freed
    as it is re-pointed. Without ``grads`` (CPU replicas in one process) there are no gradient
    buckets: backward writes each gradient fresh (from None, as ``optimizer.zero_grad()``
    leaves it) and the update adds them with ``torch._foreach_add_``. A gradient view would
    hold every gradient twice for a while: backward computes each one before adding it into
    the view, so a replica's peak would carry its largest gradient a second time (measured
    with bench/replica_memory.py on a 21M-parameter MLP whose largest weight is 80% of the
    model: 2.83x the weights per extra CPU replica with views, 2.0x without buckets).

    Args:
        params: ``params[d][k]`` is the k-th trainable parameter on device d (same order on
            every device).
        bucket_bytes: target size of one bucket.
        sources: ``sources[k]`` holds the k-th parameter's shape and values, copied into
            every device's bucket (default: each device's own parameter). A replica made
            hollow (``sharing.replica``) has only placeholders, filled here: its weights are
            never allocated outside the bucket.
        grads: keep the gradients in flat buckets too (ranks: one all-reduce per bucket;
            GPUs: one copy per bucket range towards device 0).

    Example:
        >>> a, b = nn.Linear(3, 2), nn.Linear(3, 2)
        >>> fb = FlatBuckets([list(a.parameters()), list(b.parameters())])
        >>> [len(flats) for flats in fb.grad_flat]  # one bucket per device
        [1, 1]
    """

    def __init__(self, params: Sequence[Sequence[nn.Parameter]], bucket_bytes: int = BUCKET_BYTES,
                 *, sources: Sequence[torch.Tensor] | None = None, grads: bool = True) -> None:
        self.params = [list(p) for p in params]
        plan: list[list[int]] = []
        size = 0
        master = list(sources) if sources is not None else self.params[0]
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
            values = master if sources is not None else dev_params
            for ks in plan:
                first = dev_params[ks[0]]
                total = sum(master[k].numel() for k in ks)
                pflat = torch.empty(total, dtype=first.dtype, device=first.device)
                gflat = torch.zeros(total if grads else 0, dtype=first.dtype,
                                    device=first.device)
                offset = 0
                for k in ks:
                    p, value = dev_params[k], values[k]
                    n = value.numel()
                    pflat[offset : offset + n].copy_(value.detach().reshape(-1))
                    p.data = pflat[offset : offset + n].view(value.shape)
                    if grads:
                        p.grad = gflat[offset : offset + n].view(value.shape)
                    offset += n
                pf.append(pflat)
                if grads:
                    gf.append(gflat)
            self.param_flat.append(pf)
            self.grad_flat.append(gf)
        self.grads = grads
        self.grad_views = [[p.grad for p in dev_params] for dev_params in self.params]

    def zero_device(self, d: int) -> None:
        """Zero device ``d``'s gradient buckets (on its own thread, before its backward),
        re-binding first any ``.grad`` that was replaced or cleared (``grads`` only: without
        gradient buckets, ``Update.zero_device`` sets the gradients to None)."""
        for p, v in zip(self.params[d], self.grad_views[d]):
            if p.grad is not v:
                p.grad = v
        for g in self.grad_flat[d]:
            g.zero_()


def add_into(acc: torch.Tensor, others: Sequence[torch.Tensor]) -> None:
    """The other devices' range of a gradient bucket added into device 0's ``acc``, in
    device order, each zeroed after (so a backward counts once however often it is asked)."""
    for g in others:
        acc.add_(g.to(acc.device, non_blocking=True))
        g.zero_()
