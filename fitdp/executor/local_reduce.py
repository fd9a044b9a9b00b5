"""fitdp's own engine (``LocalReduce``): one process, or several local devices per rank (the
hybrid case, which DDP cannot wrap). The replicas' trainable parameters and gradients live in
flat buckets (``FlatBuckets``); the optimizer step sums the gradients over this process's
devices into device 0's (``Update``), then ``reduce`` all-reduces device 0's buckets across
the ranks, after backward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from fitdp.executor.engine import Engine, Lead
from fitdp.executor.flat_buckets import BUCKET_BYTES, FlatBuckets
from fitdp.executor.sharing import device_replicas


class LocalReduce(Engine):
    """fitdp's own engine: one process, or several local devices per rank (see the module
    docstring). Every replica holds each weight once: device 0's keeps the host's parameter
    objects, the others are filled straight into their buckets (``device_replicas``).

    Args:
        distributed: this process is one rank of several (all-reduce after the local sum).
        bucket_bytes: the target size of one flat bucket (one all-reduce each).

    Example:
        >>> engine = LocalReduce(distributed=False)
        >>> replicas = engine.replicas(nn.Linear(3, 2), [torch.device("cpu")] * 2, None)
        >>> len(replicas), engine.reduces
        (2, False)
    """

    def __init__(self, distributed: bool, bucket_bytes: int = BUCKET_BYTES) -> None:
        self.distributed, self.bucket_bytes = distributed, bucket_bytes
        self.sources: list[nn.Parameter] = []
        self.cpu = True
        self.flat: FlatBuckets | None = None
        self.buckets: list[torch.Tensor] = []  # device 0's gradient buckets (``reduce``)

    def replicas(self, module: nn.Module, devices: Sequence[torch.device],
                 autocast_dtype: torch.dtype | None) -> list[nn.Module]:
        # One device in one process: the module itself, no buckets.
        several = len(devices) > 1 or self.distributed
        self.sources = [p for p in module.parameters() if p.requires_grad] if several else []
        self.cpu = all(d.type == "cpu" for d in devices)
        return device_replicas(module, devices, self.sources)

    def bind(self, lead: Lead, params: Sequence[Sequence[nn.Parameter]]
             ) -> FlatBuckets | None:
        if self.sources:
            grads = self.distributed or not self.cpu  # see FlatBuckets
            self.flat = FlatBuckets(params, self.bucket_bytes, sources=self.sources,
                                    grads=grads)
            self.buckets = self.flat.grad_flat[0]
        self.reduces = self.distributed and self.flat is not None
        return self.flat

    def reduce(self) -> None:
        """All-reduce (sum) device 0's gradient buckets across the ranks."""
        # Synchronous calls: gloo threads left holding async works can abort the interpreter
        # at exit, and with a few large buckets there is little to overlap anyway.
        for g in self.buckets:
            dist.all_reduce(g)
