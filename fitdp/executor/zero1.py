"""``strategy="zero1"``: DeepSpeed's ZeRO stage 1 through torch's ``ZeroRedundancyOptimizer``
(``ZeRO1``: the options; ``Zero1Engine``: the engine of a call, see
``fitdp.executor.engine``). The rank's one replica runs under DDP as with ``"ddp"`` (the
gradients summed over the ranks in backward), and the optimizer's state is split over the
ranks: each rank steps its part of the parameters, holding about 1/world size of the state
(Adam's moments), then every rank's updated part is broadcast to the others. The weights are
those of ``"ddp"``.

The compiled optimizer stays the call's front: its parameter groups are what the scheduler
sets and what each step copies into the sharded one (learning rates, weight decay); it holds
no state while the replicas run. A checkpoint holds the whole state: ``share_optimizer`` (a
collective every rank runs: the saving callbacks' share before a save, a sharded save, the
end of a fit) gathers every rank's part on every rank, as of the last optimizer step, and
rank 0's save writes it; a checkpoint loads on any world size and in one process.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import TYPE_CHECKING, Any

import torch

from fitdp.executor.ddp import DDP, DDPEngine

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from fitdp.executor.update import Update


@dataclasses.dataclass(frozen=True)
class ZeRO1(DDP):
    """``strategy="zero1"`` with options: DDP's (``static_graph``, ``bucket_cap_mb``), the
    optimizer's state sharded over the ranks.

    Example:
        >>> ZeRO1(bucket_cap_mb=50).name
        'zero1'
    """

    name: typing.ClassVar[str] = "zero1"
    # The sharded optimizer steps itself: a GradScaler could not skip its step on inf.
    scaled: typing.ClassVar[bool] = False

    def engine(self) -> Zero1Engine:
        return Zero1Engine(self)


class Zero1Engine(DDPEngine):
    """The engine of ``strategy="zero1"``: ``"ddp"``'s replica and reduce, and the optimizer
    step and state of a ``ZeroRedundancyOptimizer`` built from the call's optimizer when it
    is carried onto the replica (see the module docstring).

    Args:
        options: the ``ZeRO1`` options.
    """

    def __init__(self, options: ZeRO1) -> None:
        super().__init__(options)
        self.zero: ZeroRedundancyOptimizer | None = None
        self.front: torch.optim.Optimizer | None = None  # the call's optimizer
        # Every rank's state, gathered (or loaded) since the last step; None: stepped since.
        self.gathered: dict[str, Any] | None = None

    def carry_optimizer(self, optimizer: torch.optim.Optimizer, to_host: bool) -> None:
        """Onto the replica: the sharded optimizer made over ``optimizer``'s groups, its
        state (every rank holds it whole) split into it. To the host: every rank's part
        gathered back into ``optimizer`` (a collective unless gathered since the last step)."""
        if to_host:
            if self.zero is not None:
                whole = self._whole()
                self.zero = self.front = self.gathered = None
                optimizer.load_state_dict(_with_groups(whole, optimizer))
            return
        from torch.distributed.optim import ZeroRedundancyOptimizer

        state = optimizer.state_dict()
        self.front = optimizer
        self.zero = ZeroRedundancyOptimizer(
            [dict(group) for group in optimizer.param_groups], type(optimizer),
            **_constructor_defaults(optimizer))
        self._load(state)
        optimizer.state.clear()  # each rank's part lives in the sharded optimizer now

    def step(self, update: Update) -> None:
        """The front's hyperparameters (the scheduler's learning rate) into the sharded
        optimizer, its step on this rank's part, every part broadcast."""
        zero, front = self.zero, update.optimizer
        if zero is None or front is not self.front or front is None:
            raise RuntimeError(
                "strategy='zero1': got an optimizer step for an optimizer the replicas were "
                "not bound with; expected the compiled optimizer. Fix: step through "
                "model.fit/train_on_batch, or strategy='ddp' for other optimizers")
        for mine, theirs in zip(zero.param_groups, front.param_groups):
            mine.update({k: v for k, v in theirs.items() if k != "params"})
        zero.step()
        # An LR scheduler's wrapper of the front's step marks it so: its order check reads it.
        front._opt_called = True  # type: ignore[attr-defined]
        self.gathered = None  # (dropped: no rank holds the others' parts between saves)

    def share_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Every rank's part of the state gathered on every rank (nothing when it is already,
        as of the last step)."""
        if self.zero is not None:
            self._whole()

    def optimizer_state(self, optimizer: torch.optim.Optimizer, whole: bool) -> dict[str, Any]:
        """The whole state as of the last step (whole or sharded save alike), with the
        front's groups (the learning rate the scheduler set after the step).

        Raises:
            RuntimeError: not gathered since the last optimizer step (a save on rank 0
                alone without ``share_epoch_logs`` on every rank first).
        """
        if self.zero is None:
            return optimizer.state_dict()
        if self.gathered is None:
            raise RuntimeError(
                "model.save under strategy='zero1': got a save of the optimizer state, which "
                "each rank holds a part of, not gathered since the last optimizer step; "
                "expected model.share_epoch_logs() on every rank first (a collective). Fix: "
                "call it on every rank before rank 0's save (ModelCheckpoint and "
                "BackupAndRestore do), or save after fit (its end gathers the state)")
        return _with_groups(self.gathered, optimizer)

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer,
                             state: dict[str, Any]) -> None:
        """The front takes the groups, the sharded optimizer this rank's part of the state."""
        if self.zero is None:
            optimizer.load_state_dict(state)
            return
        optimizer.load_state_dict({"state": {}, "param_groups": state["param_groups"]})
        self._load(state)

    def _load(self, state: dict[str, Any]) -> None:
        """A whole ``state`` into the sharded optimizer (this rank keeps its part); known
        whole from now until the next step."""
        assert self.zero is not None
        if state["state"]:  # (a fresh optimizer has none)
            # (the sharded optimizer blanks the other ranks' entries of the dict it loads)
            self.zero.load_state_dict({**state, "state": dict(state["state"])})
        self.gathered = state

    def _whole(self) -> dict[str, Any]:
        """Every rank's part gathered on every rank (one consolidation per rank: each
        receives the others' parts in turn), kept until the next step."""
        zero = self.zero
        assert zero is not None
        if self.gathered is None:
            for rank in range(zero.world_size):
                zero.consolidate_state_dict(to=rank)
                if rank == zero.rank:
                    self.gathered = zero.state_dict()
        assert self.gathered is not None
        return self.gathered

    def close(self) -> None:
        self.zero = self.front = self.gathered = None
        super().close()


def _with_groups(state: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``state``'s per-parameter state with ``optimizer``'s groups (same parameter order)."""
    return {"state": state["state"], "param_groups": optimizer.state_dict()["param_groups"]}


def _constructor_defaults(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer``'s defaults that its class's constructor takes (AdamW records
    ``decoupled_weight_decay``, which its constructor does not take)."""
    accepted = inspect.signature(type(optimizer)).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}
