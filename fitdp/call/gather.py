"""What a step sees of the other replicas: the replica this thread runs (``current``), the
meeting point of one process's replica threads (``Meeting``), and ``all_gather``.

A custom training step (``Model.train_step``) runs once per device slice, on that device's
thread. ``ReplicaContext`` is set on the thread for the length of the step; outside a step
``current()`` is None and ``all_gather`` is the identity.

``all_gather`` across the replicas of one process is an autograd function: forward meets the
other replica threads and concatenates their tensors in device order; backward meets them
again and gives each replica the sum, over every replica, of the gradient of its own rows
(the reduce-scatter that ``torch.distributed.nn.functional.all_gather`` runs across ranks).
So each replica's backward stays its own (no replica's backward walks another's graph) and a
loss that couples the batch gets the gradient one device would get. Cost: two meetings per
call (a thread hand-over each, microseconds on CPU) and a copy of the gathered rows to every
device. Backward meets inside autograd, so every replica's backward must run at once on a
thread of its own: true of CPU replicas (CPU autograd runs on the thread that calls
backward) and of CUDA replicas on distinct GPUs (one autograd thread per GPU); two replicas on
one GPU share its autograd thread and would wait for each other for ever, so ``all_gather``
refuses them.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fitdp.call.ranks import Ranks

_TLS = threading.local()
WAIT_SECONDS = 300.0  # a replica that never arrives: a clear error instead of a hang


@dataclasses.dataclass
class ReplicaContext:
    """The replica a step runs on, for the step's length (see ``fitdp.executor.step``).

    Attributes:
        module: the replica's module (``self.module`` and ``self(x)`` inside a step).
        device: its device.
        index: its place in device order.
        meeting: where the replica threads of this process meet (None with one replica).
        weight: the slice's share of the batch's loss (its rows over the batch's, over every
            rank): what a manual optimizer step scales the slice's mean loss by.
        ranks: whether other ranks take part (``torch.distributed`` is initialised).
        owner: the model whose step this is (``self.module`` of another model is its own).
        fn: runs the replica (its ``torch.compile``d form with ``compile=True``).
        step: the step's caller (``fitdp.call.custom_step.CustomStep``).
        in_turn: the step runs in turn with the other replicas' (``Meeting.take_turn``):
            it passes the turn on at each meeting.
        outputs: the step's outputs for the metrics (the last ``self(x)``, or the
            ``y_pred`` given to ``compute_loss``).
    """

    module: nn.Module
    device: torch.device
    index: int
    meeting: Meeting | None
    weight: float | torch.Tensor = 1.0
    ranks: bool = False
    owner: Any = None
    fn: Callable[..., Any] | None = None
    step: Any = None
    in_turn: bool = False
    outputs: Any = None


def current() -> ReplicaContext | None:
    """The replica the calling thread's step runs on, or None outside a step."""
    return getattr(_TLS, "context", None)


class running:
    """``with running(context):`` sets the thread's replica for a step (re-entrant safe:
    the previous context comes back after)."""

    def __init__(self, context: ReplicaContext) -> None:
        self.context = context
        self.before: ReplicaContext | None = None

    def __enter__(self) -> ReplicaContext:
        self.before = current()
        _TLS.context = self.context
        return self.context

    def __exit__(self, *exc: object) -> None:
        _TLS.context = self.before


class Meeting:
    """The replica threads of one process meet here: each brings a value, all leave with
    every value in device order. Reused step after step (one generation per meeting).

    Only the replicas given rows this batch meet (``expect``): a short last batch leaves
    the others idle, and they add nothing (None in their place). Replicas that share a
    generator and draw from it run their steps in turn (``take_turn``, ``end_turn``): one
    replica at a time, in device order, from the step's start or a meeting to the next
    meeting or the step's end, so a seeded run draws the same numbers whatever the threads
    do; at a meeting the turn passes on, and after it starts again with the first replica.

    Args:
        devices: the replicas' devices, in order (one thread each).

    Example:
        >>> m = Meeting([torch.device("cpu")])
        >>> m.exchange(0, "a")
        ['a']
    """

    def __init__(self, devices: list[torch.device]) -> None:
        self.n = len(devices)
        cuda = [d for d in devices if d.type == "cuda"]
        # See the module docstring: backward's meeting needs one autograd thread per replica.
        self.shared_gpu = len(set(cuda)) < len(cuda)
        self._cond = threading.Condition()
        self._slots: list[Any] = [None] * self.n
        self._arrived = 0
        self._generation = 0
        self._result: list[Any] = []
        self._error: BaseException | None = None
        self.active = list(range(self.n))  # the replicas that meet this batch (``expect``)
        self._turn = 0  # whose turn it is: a place in ``active``

    def expect(self, active: list[int]) -> None:
        """This batch's replicas with rows, in device order: only they meet. Each of them
        sets it before it first meets (the same list from each: no race)."""
        self.active = active

    def _mine(self, index: int) -> bool:
        return self.active[self._turn] == index

    def _pass_turn(self, index: int) -> None:
        if self._mine(index):
            self._turn = (self._turn + 1) % len(self.active)
            self._cond.notify_all()

    def take_turn(self, index: int) -> None:
        """Wait until replica ``index``'s turn (the replicas before it passed it on)."""
        with self._cond:
            self._wait(index, lambda: self._mine(index) or self._error is not None)
            if self._error is not None:
                raise RuntimeError("all_gather: another replica failed in this step") \
                    from self._error

    def end_turn(self, index: int) -> None:
        """Replica ``index``'s step ended: the next replica's turn."""
        with self._cond:
            self._pass_turn(index)

    def _wait(self, index: int, ready: Callable[[], bool]) -> None:
        if not self._cond.wait_for(ready, WAIT_SECONDS):
            self._error = RuntimeError("timeout")
            self._cond.notify_all()
            raise RuntimeError(
                f"all_gather / optimizer_step: replica {index} waited {WAIT_SECONDS:.0f} s "
                f"for the other replicas; every replica's step must call them the same "
                f"number of times, in the same order (a call under an `if` that depends on "
                f"the slice is the usual cause)")

    def exchange(self, index: int, value: Any, leader: Callable[[list[Any]], Any] | None = None,
                 turn: bool = False) -> list[Any]:
        """Leave ``value``, wait for the other replicas, return every value in device order.
        ``leader``, when given, runs once on the last thread to arrive, with the values,
        before anyone leaves (what it returns replaces the list; what it raises reaches
        every replica). ``turn``: the caller holds its turn (``take_turn``); it passes it
        on, and has it again when it leaves."""
        with self._cond:
            if self._error is not None:
                raise RuntimeError("all_gather: another replica failed in this step") \
                    from self._error
            generation = self._generation
            self._slots[index] = value
            self._arrived += 1
            if turn:
                self._pass_turn(index)
            if self._arrived == len(self.active):
                values, self._slots = self._slots, [None] * self.n
                self._arrived = 0
                try:
                    self._result = values if leader is None else leader(values)
                except BaseException as e:
                    self._error = e
                    raise
                finally:
                    self._generation += 1
                    self._cond.notify_all()
            self._wait(index, lambda: self._generation != generation and (
                not turn or self._mine(index)) or self._error is not None)
            # A later meeting cannot end before this replica arrives at it: the result holds.
            if self._error is not None and (self._generation == generation or (
                    turn and not self._mine(index))):
                raise RuntimeError("all_gather: another replica failed in this step") \
                    from self._error
            return self._result

    def fail(self, error: BaseException) -> None:
        """A replica's step failed: every replica waiting (or arriving later) raises."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def reset(self) -> None:
        """Before a call: forget the last step's failure, any half-made meeting and turn."""
        with self._cond:
            self._error = None
            self._arrived = 0
            self._slots = [None] * self.n
            self._turn = 0


class _GatherReplicas(torch.autograd.Function):
    """All replicas' rows on each replica; backward: the sum of every replica's gradient of
    this replica's rows (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, context: ReplicaContext) -> torch.Tensor:
        meeting = context.meeting
        assert meeting is not None  # noqa: S101 - all_gather checks
        parts = meeting.exchange(context.index, tensor.detach(), turn=context.in_turn)
        rows = [0 if p is None else int(p.shape[0]) for p in parts]  # None: an idle replica
        ctx.context, ctx.rows = context, rows
        return torch.cat([p.to(tensor.device, non_blocking=True) for p in parts
                          if p is not None])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        context, rows = ctx.context, ctx.rows
        start = sum(rows[: context.index])
        stop = start + rows[context.index]
        grads = context.meeting.exchange(context.index, grad, turn=context.in_turn)
        mine = [g[start:stop].to(grad.device, non_blocking=True) for g in grads
                if g is not None]
        return torch.stack(mine).sum(0), None


def all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """Every replica's ``tensor`` concatenated along dim 0, in device order, then rank order:
    the rows the whole batch would have on one device. Differentiable: the gradient of each
    replica's rows is summed over every replica that used them, so a loss over the gathered
    rows (contrastive losses, batch statistics) trains as on one device.

    Outside a step (``Model.train_step`` / ``test_step`` / ``predict_step``) and with one
    replica in one process it returns ``tensor`` itself. Under torchrun it gathers across
    the ranks with ``torch.distributed.nn.functional.all_gather`` (one replica per rank;
    ranks may hold different numbers of rows).

    Args:
        tensor: this replica's rows (dim 0 is the batch).

    Returns:
        The gathered tensor, on this replica's device.

    Raises:
        TypeError: ``tensor`` is not a tensor.
        ValueError: a 0-d tensor; two replicas on one CUDA device; several replicas per
            rank under torchrun.

    Example:
        >>> all_gather(torch.ones(2, 3)).shape  # outside a step: the identity
        torch.Size([2, 3])
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"all_gather(tensor): got {type(tensor).__name__}; expected a "
                        f"torch.Tensor whose dim 0 is the batch")
    if tensor.dim() == 0:
        raise ValueError("all_gather(tensor): got a 0-d tensor; expected rows along dim 0 "
                         "(fix: tensor.reshape(1) to gather one value per replica)")
    context = current()
    if context is None:
        return tensor
    if context.meeting is not None:
        if context.ranks:
            raise ValueError(
                "all_gather: several replicas per rank under torchrun; expected one device "
                "per rank (fix: torchrun --nproc-per-node=<devices> with devices=1 each)")
        if context.meeting.shared_gpu:
            raise ValueError(
                "all_gather: two replicas on one CUDA device; expected one replica per GPU "
                "(their backward passes share the GPU's autograd thread and would wait for "
                "each other for ever). Fix: devices=[0, 1, ...], one entry per GPU")
        tensor = _GatherReplicas.apply(tensor, context)
    elif context.ranks:
        tensor = Ranks.gather_tensor(tensor)
    return tensor
