"""Averaging replicas: into the host (``copy_to``) and across replicas (``sync_buffers``).

Replicas that hold equal values must average to those values bit for bit (ten
``evaluate``/``predict`` calls on three replicas once moved 87 of 515 weights by an ulp,
through ``stack().mean(0)``). So the mean is taken as ``a0 + sum(ai - a0) / n``: the
differences of equal replicas are exact zeros, and so is their correction.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def replica_mean(block: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The mean of ``block`` (one tensor per replica) on ``device``; exact when they agree.

    Integer tensors (e.g. BatchNorm's ``num_batches_tracked``) take the floor of the mean.

    Example:
        >>> a = torch.tensor([0.1, 0.2]); replica_mean([a, a.clone(), a.clone()], a.device).equal(a)
        True
    """
    srcs = [t.to(device, non_blocking=True) for t in block]
    first = srcs[0]
    if len(srcs) == 1:
        return first
    if not first.is_floating_point():
        return torch.stack(srcs).sum(0).div(len(srcs), rounding_mode="floor").to(first.dtype)
    spread = srcs[1] - first
    for t in srcs[2:]:
        spread += t - first
    return first + spread / len(srcs)


def average_into(dst: torch.Tensor, block: Sequence[torch.Tensor]) -> None:
    """Average ``block`` into ``dst`` in place (cast to its dtype and device)."""
    with torch.no_grad():
        if len(block) == 1:
            if block[0].data_ptr() != dst.data_ptr():
                dst.copy_(block[0])
            return
        dst.copy_(replica_mean(block, dst.device))


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
            mean = replica_mean(block, block[0].device)
            if world > 1:
                mean = mean.clone() if mean is block[0] else mean
                dist.all_reduce(mean)
                mean /= world
            for t in block:
                if t is not mean:
                    t.copy_(mean, non_blocking=True)
