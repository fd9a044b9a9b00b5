"""``strategy="fsdp"``: the rank's one replica sharded by FSDP2 ``fully_shard`` (parameters,
gradients and optimizer state split over the ranks; ``FSDP``: the options; ``FSDPEngine``:
the engine of a call, see ``fitdp.executor.engine``), and the helpers that tell a shard
(a ``DTensor``) from a whole tensor for the host and for saving.

Gradients are **summed** over the ranks (a gradient divide factor of 1: fitdp's losses are
weighted by the global batch's rows already). ``torch.distributed.tensor`` and
``torch.distributed.fsdp`` cost about 0.5 s to import: they are imported by the functions
that use them, so ``import fitdp`` leaves them to a call under FSDP2.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
from torch import nn

from fitdp.checks import check_int
from fitdp.executor.engine import Engine, EngineOptions, Lead
from fitdp.executor.sharing import replica

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

    from fitdp.executor.flat_buckets import FlatBuckets


@dataclasses.dataclass(frozen=True)
class FSDP(EngineOptions):
    """``strategy="fsdp"`` with options: FSDP2 ``fully_shard`` on each block, then the root.

    Args:
        blocks: module classes sharded one instance at a time (e.g. a transformer layer);
            empty: every submodule holding at least ``min_params`` parameters of its own
            subtree whose parent does not already qualify as a block below the root.
        min_params: the size rule used when ``blocks`` is empty.
        reshard_after_forward: free the gathered parameters after forward (less memory, one
            more all-gather in backward).

    Example:
        >>> FSDP(blocks=(nn.Linear,)).min_params
        1000000
    """

    name: typing.ClassVar[str] = "fsdp"
    blocks: tuple[type[nn.Module], ...] = ()
    min_params: int = 1_000_000
    reshard_after_forward: bool = True

    def check(self) -> None:
        blocks = self.blocks if isinstance(self.blocks, (tuple, list)) else [self.blocks]
        bad = [b for b in blocks if not (isinstance(b, type) and issubclass(b, nn.Module))]
        if bad:
            raise TypeError(f"strategy: FSDP(blocks=...) got {bad!r}; expected nn.Module "
                            f"classes, e.g. FSDP(blocks=(nn.TransformerEncoderLayer,))")
        check_int("strategy: FSDP(min_params=...)", self.min_params, 0)
        self.check_flag("reshard_after_forward")

    def engine(self) -> FSDPEngine:
        return FSDPEngine(self)


def shard_fsdp(module: nn.Module, options: FSDP, autocast_dtype: torch.dtype | None
               ) -> list[nn.Module]:
    """Apply FSDP2 ``fully_shard`` in place on each block, then on ``module``; returns the
    sharded modules, root last. Parameters become DTensors (rank ``r`` holds shard ``r`` of
    dim 0); gradients are summed (divide factor 1) and reduced in float32 under bf16.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=autocast_dtype, reduce_dtype=torch.float32) \
        if autocast_dtype is not None else MixedPrecisionPolicy()
    blocks = _blocks(module, options)
    for block in [*blocks, module]:
        fully_shard(block, mp_policy=policy,
                    reshard_after_forward=options.reshard_after_forward)
        block.set_gradient_divide_factor(1.0)  # type: ignore[operator]
        # a plain SUM (gloo has no PREMUL_SUM; NCCL's sum is as fast)
        block.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
    return [*blocks, module]


def _blocks(module: nn.Module, options: FSDP) -> list[nn.Module]:
    """The submodules sharded one by one: instances of ``options.blocks``, else the largest
    subtrees of at least ``options.min_params`` parameters below the root (outermost first
    match wins, so no block holds another). A subtree holding a parameter that a module
    outside it holds too (tied weights: GPT-2's ``lm_head`` and ``wte``) is no block: FSDP2
    refuses a parameter in two groups, so the tie stays with the root's. A container without
    a forward of its own (``nn.ModuleList``) is no block either: its items are."""
    found: list[nn.Module] = []
    owners: dict[int, set[int]] = {}  # parameter -> the modules holding it directly
    for m in module.modules():
        for p in m._parameters.values():
            if p is not None:
                owners.setdefault(id(p), set()).add(id(m))

    def closed(m: nn.Module) -> bool:
        inside = {id(x) for x in m.modules()}
        return all(owners[id(p)] <= inside for p in m.parameters())

    def visit(m: nn.Module) -> None:
        for child in m.children():
            size = sum(p.numel() for p in child.parameters())
            hit = (isinstance(child, options.blocks) if options.blocks
                   else size >= options.min_params) and closed(child) and \
                type(child).forward is not nn.Module.forward  # (a ModuleList: its items)
            if hit:
                found.append(child)
            else:
                visit(child)

    visit(module)
    return found


class FSDPEngine(Engine):
    """The engine of ``strategy="fsdp"``: the rank's one replica, a copy of the host module
    sharded in place; every backward reduce-scatters its gradients, so nothing is left to the
    optimizer step. The host keeps whole tensors (what ``get_weights``, ``save`` and
    ``export`` read): storing it gathers the shards, a collective every rank joins, skipped
    while no shard changed since the last store (tensor versions).

    Args:
        options: the ``FSDP`` options.
    """

    shards_weights = True

    def __init__(self, options: FSDP) -> None:
        self.options = options
        self.masters: list[nn.Parameter] = []
        self.versions: list[int] | None = None  # the shards' when the host last matched

    def replicas(self, module: nn.Module, devices: Sequence[torch.device],
                 autocast_dtype: torch.dtype | None) -> list[nn.Module]:
        # Sharded before anything reads its parameters (sharding replaces them by DTensors).
        copy = replica(module, devices[0], share=False)
        shard_fsdp(copy, self.options, autocast_dtype)
        return [copy]

    def bind(self, lead: Lead, params: Sequence[Sequence[nn.Parameter]]
             ) -> FlatBuckets | None:
        lead.ranked = lead.module  # an empty share still runs it (the step's collectives)
        self.masters = list(params[0])
        return None

    def copy_into(self, dst: torch.Tensor, value: torch.Tensor) -> None:
        """This rank's part of ``value`` into the shard ``dst`` (every rank holds ``value``:
        no communication)."""
        if is_shard(dst):
            from torch.distributed.tensor import distribute_tensor

            value = distribute_tensor(value.to(dst.device), dst.device_mesh, dst.placements,
                                      src_data_rank=None)
        dst.detach().copy_(value, non_blocking=True)

    def whole(self, block: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """Shards gathered into whole tensors (a collective: every rank asks for the same
        tensors in the same order)."""
        return [t.full_tensor() if is_shard(t) else t for t in block]

    def host_current(self) -> bool:
        return self.versions == self._versions()

    def stored(self) -> None:
        self.versions = self._versions()

    def _versions(self) -> list[int]:
        """The in-place version counter of each shard: unchanged numbers mean no shard was
        stepped since they were read."""
        return [p._version for p in self.masters]

    def carry_optimizer(self, optimizer: torch.optim.Optimizer, to_host: bool) -> None:
        reshard_state(optimizer, to_host)

    def optimizer_state(self, optimizer: torch.optim.Optimizer, whole: bool) -> dict[str, Any]:
        """The state of the shards gathered into whole tensors (a collective: every rank
        saves), so the checkpoint loads on any world size and in one process; or, not
        ``whole``, the shards as they are (a sharded checkpoint writes each rank's)."""
        state = optimizer.state_dict()
        return whole_state(state) if whole else state

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer,
                             state: dict[str, Any]) -> None:
        optimizer.load_state_dict(state)
        reshard_state(optimizer, to_host=False)  # this rank's part of each whole tensor


def is_shard(value: object) -> TypeGuard[DTensor]:
    """Whether ``value`` is an FSDP2 shard (a DTensor). Before ``torch.distributed.tensor``
    is imported (by FSDP2) no DTensor exists."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def reshard_state(optimizer: torch.optim.Optimizer, to_host: bool) -> None:
    """The optimizer state of FSDP2-sharded parameters between the host (whole tensors, on
    every rank, for saving) and the replica (shards): after ``bind_optimizer`` moved the
    optimizer to the host's parameters (``to_host``) or to the shards. A collective when
    ``to_host``: every rank's state has the same keys in the same order."""
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if to_host and is_shard(value):
                state[key] = value.full_tensor()
            elif not to_host and is_shard(param) and isinstance(
                    value, torch.Tensor) and not is_shard(value) \
                    and value.shape == param.shape:
                from torch.distributed.tensor import distribute_tensor

                state[key] = distribute_tensor(value, param.device_mesh, param.placements,
                                               src_data_rank=None)


def whole_state(state_dict: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's ``state_dict`` with FSDP2 shards gathered into whole tensors (a
    collective, as ``reshard_state``)."""
    state = {i: {k: v.full_tensor() if is_shard(v) else v for k, v in s.items()}
             for i, s in state_dict["state"].items()}
    return {**state_dict, "state": state}
