"""PyTorch's own cross-rank engines for a rank that drives one device: ``DistributedDataParallel``
(gradients all-reduced in buckets while backward runs) and FSDP2 ``fully_shard`` (parameters,
gradients and optimizer state sharded over the ranks).

``compile(strategy=...)`` takes ``"auto"``, ``"ddp"``, ``"fsdp"`` or one of the option
objects below; ``engine_for`` turns it, with the call's devices and world size, into the
engine the executor wraps its replica with (or None: the executor's own flat-bucket
reduction, the only way for several local devices per rank).

Both engines keep fitdp's gradient arithmetic: each rank's loss is already weighted by its
rows over the global batch's, so gradients are **summed** over ranks, not averaged (DDP through
a summing comm hook, FSDP2 through a gradient divide factor of 1). Ranks with uneven last
batches therefore still give the whole-batch gradient.
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import inspect
import sys
import typing
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
import torch.distributed as dist
from torch import nn

from fitdp.checks import check_int, check_number
from fitdp.executor.sharing import replica

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

STRATEGIES = ("auto", "ddp", "fsdp")


@dataclasses.dataclass(frozen=True)
class DDP:
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

    static_graph: bool = False
    bucket_cap_mb: float = 25.0


@dataclasses.dataclass(frozen=True)
class FSDP:
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

    blocks: tuple[type[nn.Module], ...] = ()
    min_params: int = 1_000_000
    reshard_after_forward: bool = True


Strategy = str | DDP | FSDP


def check_strategy(value: Any) -> Strategy:
    """``compile(strategy=...)``'s value, checked (combinations are checked per call).

    Raises:
        ValueError, TypeError: naming what was received and what is expected.
    """
    if isinstance(value, FSDP):
        blocks = value.blocks if isinstance(value.blocks, (tuple, list)) else [value.blocks]
        bad = [b for b in blocks if not (isinstance(b, type) and issubclass(b, nn.Module))]
        if bad:
            raise TypeError(f"strategy: FSDP(blocks=...) got {bad!r}; expected nn.Module "
                            f"classes, e.g. FSDP(blocks=(nn.TransformerEncoderLayer,))")
        check_int("strategy: FSDP(min_params=...)", value.min_params, 0)
        _check_flag("FSDP", "reshard_after_forward", value.reshard_after_forward)
    if isinstance(value, DDP):
        _check_flag("DDP", "static_graph", value.static_graph)
        check_number("strategy: DDP(bucket_cap_mb=...)", value.bucket_cap_mb, low=0,
                     low_open=True, fix="e.g. DDP(bucket_cap_mb=25), DDP's default")
    if isinstance(value, (DDP, FSDP)):
        return value
    if not isinstance(value, str) or value not in STRATEGIES:
        raise ValueError(f"strategy: got {value!r}; expected one of {list(STRATEGIES)} or "
                         f"fitdp.DDP(...)/fitdp.FSDP(...). Fix: strategy='auto' (DDP when each "
                         f"rank drives one device)")
    return value


def _check_flag(kind: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"strategy: {kind}({name}=...) got {value!r}; expected True or False")


def engine_for(strategy: Strategy, devices: Sequence[torch.device], world_size: int,
               bucketed: bool = False, compiled: bool = False, custom_step: bool = False
               ) -> DDP | FSDP | None:
    """The engine for a call: DDP or FSDP2 for one device per rank, None for the executor's
    own reduction (one process, several local devices per rank, or under ``"auto"`` a
    ``bucket_module``, each bucket running its own module, which one wrapper cannot cover,
    ``compile``, or a custom step).

    Raises:
        ValueError: ``"ddp"``/``"fsdp"`` that cannot work here, naming why and the fix.
    """
    name = "fsdp" if isinstance(strategy, FSDP) else "ddp" if isinstance(strategy, DDP) \
        else strategy
    if name == "auto":
        return DDP() if world_size > 1 and len(devices) == 1 and not (
            bucketed or compiled or custom_step) else None
    if world_size < 2:
        raise ValueError(
            f"compile(strategy={name!r}): got one process (WORLD_SIZE={world_size}); expected "
            f"a torchrun job of several ranks. Fix: launch with torchrun --nproc-per-node N, "
            f"or strategy='auto' (replicas in this process)")
    if len(devices) > 1:
        raise ValueError(
            f"compile(strategy={name!r}): got {len(devices)} local devices in one process "
            f"({[str(d) for d in devices]}); expected one device per rank ({name} wraps one "
            f"device's module). Fix: one process per device (torchrun --nproc-per-node "
            f"{len(devices)}) with devices='auto', or strategy='auto' for local replicas")
    if compiled:
        raise ValueError(
            f"compile(strategy={name!r}, compile=...): got torch.compile with {name}; "
            f"expected one of them in this version. Fix: compile=False, or strategy='auto' "
            f"(compiled replicas with fitdp's own reduction)")
    if custom_step:
        raise ValueError(
            f"compile(strategy={name!r}): got a Model that overrides train_step/compute_loss; "
            f"expected the default step in this version (a custom step may call the module "
            f"around {name}'s wrapper). Fix: strategy='auto' (fitdp's own reduction runs "
            f"custom steps)")
    if bucketed:
        raise ValueError(
            f"compile(strategy={name!r}): got a Model with bucket_module; expected one module "
            f"({name} wraps one module, each bucket runs its own). Fix: strategy='auto' "
            f"(fitdp's own reduction covers every bucket)")
    if isinstance(strategy, (DDP, FSDP)):
        return strategy
    return DDP() if name == "ddp" else FSDP()


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
    match wins, so no block holds another)."""
    found: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            size = sum(p.numel() for p in child.parameters())
            hit = isinstance(child, options.blocks) if options.blocks \
                else size >= options.min_params
            if hit:
                found.append(child)
            else:
                visit(child)

    visit(module)
    return found


def engine_replica(engine: DDP | FSDP, module: nn.Module, device: torch.device,
                   autocast_dtype: torch.dtype | None) -> nn.Module:
    """Put this rank's one replica ``module`` (on ``device``) under ``engine``; returns what
    forward runs through: the DDP wrapper, or ``module`` itself sharded in place by FSDP2
    (before anything reads its parameters: sharding replaces them with DTensors)."""
    if isinstance(engine, DDP):
        return wrap_ddp(module, device, engine)
    shard_fsdp(module, engine, autocast_dtype)
    return module


def fsdp_replica(module: nn.Module, device: torch.device, options: FSDP,
                 autocast_dtype: torch.dtype | None) -> nn.Module:
    """This rank's replica under FSDP2: a copy of the host ``module`` on ``device``, sharded
    (the host keeps whole tensors: what ``get_weights``, ``save`` and ``export`` read, so
    each rank holds one unsharded copy of the parameters on the host side)."""
    return engine_replica(options, replica(module, device, share=False), device,
                          autocast_dtype)


def bind_engine(engine: DDP | FSDP, ex: Any, masters: Sequence[nn.Parameter]
                ) -> Callable[[], None] | None:
    """Run executor ``ex``'s replica (this rank's one) under its engine from now on;
    ``ex.ranked`` names the engine's module for ``set_sync`` and ``empty_share``.

    FSDP2 (``ex.module`` already sharded by ``fsdp_replica``) reduce-scatters in every
    backward: nothing is left to the step (None). DDP: forward goes through the wrapper,
    whose bucket all-reduces overlap backward. Returns the reduction left to the optimizer
    step (the manager's ``cross_rank``): nothing after a backward that reduced; after
    backwards that ran with sync off and then step (a call's first batch, stepped after its
    checks; an epoch's last, short accumulation), every gradient all-reduced there, once."""
    if isinstance(engine, FSDP):
        ex.ranked = ex.module
        return None
    ex.ranked = ex.fn = engine_replica(engine, ex.module, ex.device, None)
    # DDP's reducer must be gone before the process group is torn down at exit (a rank
    # aborted there once: "terminate called without an active exception"). Registered
    # after the join's exit hook, so it runs first.
    atexit.register(_unbind, weakref.ref(ex))

    def catch_up() -> None:  # (reads the wrapper through ``ex``: see _unbind)
        if ex.ranked is None or ex.ranked.require_backward_grad_sync:
            return
        for p in masters:
            if p.grad is None:  # no backward reached it on this rank (an empty share)
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)

    return catch_up


def _unbind(ref: weakref.ref[Any]) -> None:
    ex = ref()
    if ex is not None and ex.ranked is not None:
        ex.fn, ex.ranked = ex.module, None
        gc.collect()


def set_sync(wrapped: nn.Module, on: bool) -> None:
    """Whether the next backward reduces across ranks (False while accumulating): DDP's
    ``no_sync`` flag (read in forward). FSDP2 reduce-scatters every backward, accumulating in
    the gradient shards: a step may follow backwards that did not sync (a call's first
    batch), whose unsharded gradients FSDP2 would never reduce (costs one reduce-scatter per
    accumulated micro-batch)."""
    if isinstance(wrapped, nn.parallel.DistributedDataParallel):
        wrapped.require_backward_grad_sync = on


def empty_share(wrapped: nn.Module, inputs: Any) -> None:
    """A rank whose share of a step is empty (zero rows) still takes part in the step's
    collectives: forward on the zero rows and backward of a zero loss, so DDP's bucket
    all-reduces (and FSDP2's all-gathers and reduce-scatters) meet the other ranks' with
    zero gradients."""
    outputs = wrapped(inputs) if isinstance(inputs, torch.Tensor) else (
        wrapped(**inputs) if isinstance(inputs, dict) else wrapped(*inputs))
    leaves = [t for t in _leaves(outputs) if t.requires_grad]
    if leaves:
        (sum(t.float().sum() for t in leaves) * 0.0).backward()  # type: ignore[union-attr]


def _leaves(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        tree = list(tree.values())
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in _leaves(item)]
    return []


def is_shard(value: object) -> TypeGuard[DTensor]:
    """Whether ``value`` is an FSDP2 shard (a DTensor). ``torch.distributed.tensor`` costs
    about 0.5 s to import, so ``import fitdp`` leaves it to FSDP2: before that module is
    imported no DTensor exists."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def copy_into(dst: torch.Tensor, value: torch.Tensor) -> None:
    """``dst.copy_(value)``, where ``dst`` may be an FSDP2 shard of the whole ``value``: this
    rank's part of it (every rank holds ``value``: no communication)."""
    if is_shard(dst):
        from torch.distributed.tensor import distribute_tensor

        value = distribute_tensor(value.to(dst.device), dst.device_mesh, dst.placements,
                                  src_data_rank=None)
    dst.detach().copy_(value, non_blocking=True)


def whole(block: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """``block`` with FSDP2 shards gathered into whole tensors (a collective: every rank
    asks for the same tensors in the same order)."""
    return [t.full_tensor() if is_shard(t) else t for t in block]


def shard_versions(params: Iterable[torch.Tensor]) -> list[int]:
    """The in-place version counter of each sharded (DTensor) parameter: unchanged numbers
    mean no shard was stepped since they were read."""
    return [p._version for p in params if is_shard(p)]


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
