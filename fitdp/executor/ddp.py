"""``strategy="ddp"``: the rank's one replica under PyTorch's ``DistributedDataParallel``,
whose bucket all-reduces run while backward goes on (``DDP``: the options; ``DDPEngine``:
the engine of a call, see ``fitdp.executor.engine``).

Gradients are **summed** over the ranks through a summing comm hook (DDP's default divides by
the world size; fitdp's losses are weighted by the global batch's rows already).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import gc
import inspect
import typing
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from fitdp.checks import check_number
from fitdp.executor.engine import Engine, EngineOptions, Lead
from fitdp.executor.sharing import device_replicas

if TYPE_CHECKING:
    from fitdp.executor.flat_buckets import FlatBuckets


@dataclasses.dataclass(frozen=True)
class DDP(EngineOptions):
    """``strategy="ddp"`` with options: the rank's replica under ``DistributedDataParallel``.

    Args:
        static_graph: the same parameters take part in every step, in the same order (lets
            DDP skip re-checking the graph each step; wrong for bucketed models whose buckets
            use different parameters).
        bucket_cap_mb: the size of one all-reduce bucket (DDP's default 25).

    Example:
        >>> DDP(static_graph=True).bucket_cap_mb
        25.0
    """

    name: typing.ClassVar[str] = "ddp"
    static_graph: bool = False
    bucket_cap_mb: float = 25.0

    def check(self) -> None:
        self.check_flag("static_graph")
        check_number("strategy: DDP(bucket_cap_mb=...)", self.bucket_cap_mb, low=0,
                     low_open=True, fix="e.g. DDP(bucket_cap_mb=25), DDP's default")

    def engine(self) -> DDPEngine:
        return DDPEngine(self)


def _sum_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce one bucket as a sum (DDP's default divides by the world size)."""
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


# DDP checks the hook's annotations as objects; this module's are strings (PEP 563).
_sum_hook.__annotations__ = typing.get_type_hints(_sum_hook)


# Buffers are not synced by DDP (fitdp broadcasts rank 0's state when a call starts). torch
# 2.13 renamed broadcast_buffers, which now warns on every rank, to forward_sync_buffers;
# under init_sync=False the two mean the same.
_DDP_ARGS = inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
_NO_BUFFER_SYNC: dict[str, Any] = {
    "forward_sync_buffers" if "forward_sync_buffers" in _DDP_ARGS else "broadcast_buffers": False}


def wrap_ddp(module: nn.Module, device: torch.device, options: DDP
             ) -> nn.parallel.DistributedDataParallel:
    """``module`` (already on ``device``, equal on every rank) under DDP, summing gradients.

    ``gradient_as_bucket_view``: each ``.grad`` is a view into DDP's bucket, so gradients
    are not held twice (one parameter-sized copy less per rank).
    """
    ddp = nn.parallel.DistributedDataParallel(
        module, device_ids=[device] if device.type == "cuda" else None,
        bucket_cap_mb=options.bucket_cap_mb, gradient_as_bucket_view=True,
        static_graph=options.static_graph,
        init_sync=False, **_NO_BUFFER_SYNC)  # fitdp broadcasts rank 0's weights itself
    ddp.register_comm_hook(None, _sum_hook)
    return ddp


class DDPEngine(Engine):
    """The engine of ``strategy="ddp"``: the rank's one replica's forward runs through the
    DDP wrapper, whose all-reduces overlap backward on the batch that steps.

    Args:
        options: the ``DDP`` options.
    """

    reduces = True
    prepares = True

    def __init__(self, options: DDP) -> None:
        self.options = options
        self.wrapper: nn.parallel.DistributedDataParallel | None = None
        self.lead: Lead | None = None
        self.masters: list[nn.Parameter] = []
        self._at_exit = functools.partial(_close, weakref.ref(self))

    def replicas(self, module: nn.Module, devices: Sequence[torch.device],
                 autocast_dtype: torch.dtype | None) -> list[nn.Module]:
        return device_replicas(module, devices, ())

    def bind(self, lead: Lead, params: Sequence[Sequence[nn.Parameter]]
             ) -> FlatBuckets | None:
        # ``ranked``: the module an empty share still runs (the step's collectives).
        lead.ranked = lead.fn = self.wrapper = wrap_ddp(lead.module, lead.device, self.options)
        self.lead, self.masters = lead, list(params[0])
        # DDP's reducer must be gone before the process group is torn down at exit (a rank
        # aborted there once: "terminate called without an active exception"). Registered
        # after the join's exit hook, so it runs first; ``close`` removes it.
        atexit.register(self._at_exit)
        return None

    def prepare(self, stepping: bool) -> None:
        """DDP's ``no_sync`` flag (read in forward): only the batch that steps reduces."""
        if self.wrapper is not None:
            self.wrapper.require_backward_grad_sync = stepping

    def reduce(self) -> None:
        """Nothing after a backward that reduced; after backwards that ran with sync off
        and then step (a call's first batch, stepped after its checks; an epoch's last,
        short accumulation), every gradient all-reduced here, once."""
        if self.wrapper is None or self.wrapper.require_backward_grad_sync:
            return
        for p in self.masters:
            if p.grad is None:  # no backward reached it on this rank (an empty share)
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)

    def close(self) -> None:
        """The replica runs without the wrapper from now on (its reducer is freed)."""
        atexit.unregister(self._at_exit)
        lead, self.lead, self.wrapper = self.lead, None, None
        if lead is not None:
            lead.fn, lead.ranked = lead.module, None
            gc.collect()


def _close(ref: weakref.ref[DDPEngine]) -> None:
    engine = ref()
    if engine is not None:
        engine.close()
