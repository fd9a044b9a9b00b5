"""The engine interface: how a call's replicas are made and how their gradients and weights
cross devices and ranks.

One engine is chosen per call (``fitdp.executor.engines.engine_for``) and held by the
executor manager; the step and the layers above call its few operations and never ask which
engine they have (as Lightning Fabric's ``Strategy``). Each engine lives in its own file,
with the torch types it uses:

- ``fitdp.executor.local_reduce.LocalReduce``: fitdp's own reduction. One process, or several
  local devices per rank: the replicas' gradients are summed locally in flat buckets, then
  the buckets are all-reduced across the ranks after backward.
- ``fitdp.executor.ddp.DDPEngine``: the rank's one replica under torch's DDP wrapper.
- ``fitdp.executor.fsdp.FSDPEngine``: the rank's one replica sharded by FSDP2.

Every engine keeps fitdp's gradient arithmetic: each slice's loss is already weighted by its
rows over the global batch's, so gradients are **summed** over devices and ranks, never
averaged. Ranks with uneven last batches therefore still give the whole-batch gradient.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from fitdp.executor.flat_buckets import FlatBuckets


class Lead(Protocol):
    """What an engine binds of device 0's replica (``fitdp.executor.replica.Executor``)."""

    module: nn.Module
    device: torch.device
    fn: Callable[..., Any]  # what forward runs: the module, or the engine's wrapper of it
    ranked: nn.Module | None  # what an empty share still runs (the step's collectives)


class EngineOptions(abc.ABC):
    """The options of a strategy (``fitdp.DDP``, ``fitdp.FSDP``): checked by ``compile``,
    made into the call's engine when a call attaches its replicas."""

    name: ClassVar[str]  # the strategy's string shortcut ("ddp", "fsdp")
    scaled: ClassVar[bool] = True  # runs with a GradScaler (precision="16-mixed")

    def check(self) -> None:
        """Raise ``ValueError``/``TypeError`` naming an option that cannot work."""
        return None  # the default: nothing to do

    @abc.abstractmethod
    def engine(self) -> Engine:
        """A new engine with these options (one per call's replicas)."""

    def check_flag(self, name: str) -> None:
        """Raise ``TypeError`` unless option ``name`` is a bool."""
        value = getattr(self, name)
        if not isinstance(value, bool):
            raise TypeError(f"strategy: {type(self).__name__}({name}=...) got {value!r}; "
                            f"expected True or False")


class Engine(abc.ABC):
    """How a call's replicas share the work (see the module docstring). The defaults are
    those of an engine whose replicas hold whole tensors.

    Attributes:
        shards_weights: each rank holds a shard of every parameter (saving writes shards).
        reduces: ``reduce`` has work to do after backward (checked once, at bind).
        prepares: ``prepare`` has work to do before a training batch (checked once per
            bound step: a step of an engine without it never calls it).
    """

    shards_weights: bool = False
    reduces: bool = False
    prepares: bool = False

    @abc.abstractmethod
    def replicas(self, module: nn.Module, devices: Sequence[torch.device],
                 autocast_dtype: torch.dtype | None) -> list[nn.Module]:
        """One replica of the host ``module`` per device."""

    @abc.abstractmethod
    def bind(self, lead: Lead, params: Sequence[Sequence[nn.Parameter]]
             ) -> FlatBuckets | None:
        """Run the replicas under this engine from now on: ``lead`` is device 0's executor,
        ``params[d]`` device ``d``'s trainable parameters. Returns the flat gradient buckets
        the optimizer step sums over the devices, or None."""

    def prepare(self, stepping: bool) -> None:
        """Before a training batch: whether its backward ends with the optimizer step."""
        return None  # the default: nothing to do

    def reduce(self) -> None:
        """After the local sum, before the optimizer step: device 0's gradients summed over
        the ranks."""
        return None  # the default: nothing to do

    def copy_into(self, dst: torch.Tensor, value: torch.Tensor) -> None:
        """A host tensor ``value`` into the replicas' ``dst``."""
        dst.detach().copy_(value, non_blocking=True)

    def whole(self, block: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """The replicas' copies of one tensor, each whole (for the host)."""
        return block

    def host_current(self) -> bool:
        """Whether the host's parameters hold the replicas' already (no store needed)."""
        return False

    def stored(self) -> None:
        """The host's parameters and the replicas' agree now."""
        return None  # the default: nothing to do

    def carry_optimizer(self, optimizer: torch.optim.Optimizer, to_host: bool) -> None:
        """The optimizer's state moved with its parameters between the host (``to_host``)
        and the replicas."""
        return None  # the default: nothing to do

    # -- the optimizer: its state (an engine that steps it too defines ``step(update)``:
    # ``update.optimizer`` on device 0's reduced, unscaled and clipped gradients; without
    # one, the update's own ``optimizer.step()`` runs, found once per bound update) --------

    def share_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Every rank, before rank 0 alone saves: gather what its ``optimizer_state`` needs
        from the other ranks (a collective)."""
        return None  # the default: every rank holds its optimizer's whole state

    def optimizer_state(self, optimizer: torch.optim.Optimizer, whole: bool) -> dict[str, Any]:
        """The state dict of ``optimizer`` (bound to the replicas) for a checkpoint: whole
        tensors, or (not ``whole``: a sharded save, every rank writes) as this rank holds it."""
        return optimizer.state_dict()

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer,
                             state: dict[str, Any]) -> None:
        """A checkpoint's whole ``state`` into ``optimizer`` (bound to the replicas), held as
        the engine holds it."""
        optimizer.load_state_dict(state)

    def close(self) -> None:
        """Release what the engine holds of the replicas (the manager closes)."""
        return None  # the default: nothing to do


def empty_share(wrapped: nn.Module, inputs: Any) -> None:
    """A rank whose share of a step is empty (zero rows) still takes part in the step's
    collectives: forward on the zero rows and backward of a zero loss, so a wrapper's bucket
    all-reduces (or a sharded module's all-gathers and reduce-scatters) meet the other ranks'
    with zero gradients."""
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
