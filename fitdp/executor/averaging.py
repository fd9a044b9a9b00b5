"""Averaging replicas: into the host (``copy_to``) and across replicas (``sync_buffers``).

Replicas that hold equal values must average to those values bit for bit (ten
``evaluate``/``predict`` calls on three replicas once moved 87 of 515 weights by an ulp,
through ``stack().mean(0)``). So the mean is ``lerp(a0, a1, 0.5)`` for two replicas and
``a0 + sum(ai - a0) / n`` for more: both are exact for equal replicas (the differences are
exact zeros), and both take one pass over memory per replica, in place when they can.

The mean is taken on the first replica's device and reaches the host in one blocking copy:
a device-to-host copy with ``non_blocking=True`` returns before its data lands, so a mean
taken on the host at once would read stale or torn weights. Copies between devices are
ordered by their streams either way, so the other replicas come to the first one's device
without a host sync; the single blocking copy at the end is the one sync ``copy_to`` costs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def replica_mean(block: Sequence[torch.Tensor], out: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """The mean of ``block`` (one tensor per replica) on the first one's device; exact when
    they agree.

    Two replicas take one ``lerp`` pass (exact for equal values: it returns ``b - (b - a) / 2``
    there); more take ``a0 + sum(ai - a0) / n`` in one scratch tensor. Integer tensors (e.g.
    BatchNorm's ``num_batches_tracked``) take the floor of the mean. ``out``: write it there
    (same dtype, on that device).

    Example:
        >>> a = torch.tensor([0.1, 0.2]); replica_mean([a, a.clone(), a.clone()]).equal(a)
        True
    """
    first = block[0]
    # Towards a GPU: ordered by the streams, no host sync. Towards the host (a CPU replica
    # first, a GPU one after it): blocking, or the mean would read it before it lands.
    to_gpu = first.device.type != "cpu"
    srcs = [first, *(t.to(first.device, non_blocking=to_gpu) for t in block[1:])]
    if len(srcs) == 1:
        return first
    if not first.is_floating_point():
        return torch.stack(srcs).sum(0).div(len(srcs), rounding_mode="floor").to(first.dtype)
    if len(srcs) == 2:
        return torch.lerp(first, srcs[1], 0.5, out=out) if out is not None else torch.lerp(
            first, srcs[1], 0.5)
    spread = srcs[1] - first
    for t in srcs[2:]:
        spread.add_(t).sub_(first)
    return torch.add(first, spread, alpha=1 / len(srcs), out=out) if out is not None else \
        torch.add(first, spread, alpha=1 / len(srcs))


def average_into(dst: torch.Tensor, block: Sequence[torch.Tensor]) -> None:
    """Average ``block`` into ``dst`` in place (cast to its dtype and device): on the first
    replica's device, then one blocking copy into ``dst`` (its values are there on return)."""
    with torch.no_grad():
        if len(block) == 1:
            if block[0].data_ptr() != dst.data_ptr():
                dst.copy_(block[0])
            return
        # dst may be the first replica itself (device 0's replica holds the host's weights):
        # the mean is elementwise, so it is written over it in place, without a scratch copy.
        direct = dst.device == block[0].device and dst.dtype == block[0].dtype and \
            block[0].is_floating_point() and all(t.data_ptr() != dst.data_ptr()
                                                 for t in block[1:])
        if direct:  # the CPU replicas' path: one pass, written straight into dst
            replica_mean(block, out=dst)
        else:
            dst.copy_(replica_mean(block))


def average_replicas(arrays: Sequence[Sequence[torch.Tensor]], *, distributed: bool) -> None:
    """Average each floating tensor over its replicas (and every rank), into all of them.

    Args:
        arrays: ``[tensor][device]``, e.g. the manager's ``aux_arrays``.
        distributed: also average over the ranks of the default process group (every rank
            must call this at the same point).
    """
    world = dist.get_world_size() if distributed else 1
    with torch.no_grad():
        for block in arrays:
            if not block[0].is_floating_point() or (len(block) == 1 and world == 1):
                continue
            mean = replica_mean(block)
            if world > 1:
                mean = mean.clone() if mean is block[0] else mean
                dist.all_reduce(mean)
                mean /= world
            for t in block:
                if t is not mean:
                    t.copy_(mean, non_blocking=True)
