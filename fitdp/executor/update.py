"""The optimizer update of a training step, the one place the executor steps an optimizer.

An ``Update`` is bound once per call from what the call fixes: its ``UpdateOptions``
(optimizer, ``GradScaler``, clipping norm, profiler ranges, whether the engine's cross-rank
reduction is left to it), the flat gradient buckets and the engine. ``new_update`` is the one
place an update is made (the manager's ``update`` keeps one per options; the built-in step,
the reproducible step and a custom step's ``optimizer_step`` all step through it). The bound
step runs ``apply`` on a batch that ends with an optimizer step (an update without an
optimizer only zeroes). Its parts run in order:

- ``zero_device(d)``: device ``d``'s gradients zeroed, on its thread, before its backward
  (the batch that starts an optimizer step);
- ``apply()``: the ``before_step`` hooks (an async save still copying the weights waits
  there), the gradients summed over the devices into device 0's (then across ranks:
  the engine's ``reduce``), unscaled and clipped, the optimizer step (the engine's ``step``
  where the engine owns it: ZeRO-1's sharded optimizer), and device 0's parameters copied
  to every other device.

On CPU replicas without ranks the buckets hold no gradients (``FlatBuckets`` says why: a
replica then holds its weights and gradients once each): backward writes fresh gradients after
the zeroing sets them to None, as a hand-written loop's ``zero_grad()`` does, and the reduce
adds them with one ``torch._foreach_add_`` per device, then drops the other devices' (so each
backward counts once however often the reduce is asked).
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from fitdp.executor.flat_buckets import FlatBuckets, add_into

_NULL = contextlib.nullcontext()  # reusable: entering it has no state
_GRAD = operator.attrgetter("grad")  # a parameter's gradient (C: no Python frame per read)


class Engine(Protocol):
    """What an update asks of the call's engine (``fitdp.executor.engine.Engine``); an engine
    that steps the optimizer itself (ZeRO-1) also has ``step(update)``."""

    reduces: bool

    def reduce(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class UpdateOptions:
    """What a call fixes of its optimizer step (one value, the key of the manager's updates).

    Attributes:
        optimizer: what steps device 0's trainable parameters (None: an update that only
            zeroes and reduces).
        scaler: the ``GradScaler`` of a 16-mixed run, or None.
        clip_norm: max global norm of the gradients, or None.
        named: the reduce and the step in profiler ranges (``NamedUpdate``).
        cross_rank: the engine's cross-rank reduce runs in the update (False: the step
            summed the ranks' gradients itself, as the reproducible step does).
        track_norm: every step takes the gradients' global norm before clipping, on the
            device (``state.grad_norm``; clipping takes it anyway).
        inspect: called with the optimizer after the reduce and the unscale, before
            clipping and the step (``on_before_optimizer_step``), or None.

    Example:
        >>> UpdateOptions(clip_norm=1.0) == UpdateOptions(clip_norm=1.0)  # one kept update
        True
    """

    optimizer: torch.optim.Optimizer | None = None
    scaler: torch.amp.GradScaler | None = None
    clip_norm: float | None = None
    named: bool = False
    cross_rank: bool = True
    track_norm: bool = False
    inspect: Callable[[torch.optim.Optimizer], None] | None = None


def new_update(options: UpdateOptions, flat: FlatBuckets | None,
               masters: Sequence[nn.Parameter], engine: Engine | None = None,
               before_step: list[Callable[[], None]] | None = None) -> Update:
    """The update ``options`` describe, over the replicas' ``flat`` buckets and device 0's
    trainable parameters ``masters``, stepping through ``engine`` (see ``Update``)."""
    kind = NamedUpdate if options.named else Update
    return kind(flat, masters, options, engine=engine, before_step=before_step)


class StepState:
    """What the last optimizer step saw, read-only, on the device: nothing here syncs with
    the host; whoever reads a value as a number (``float(state.grad_norm)``) pays that sync,
    at a log point (``fitdp.callbacks.GradNormLogger``).

    Attributes:
        grad_norm: the global L2 norm of the reduced, unscaled gradients before clipping (a
            0-d tensor on device 0), or None unless the step was bound to track it or clips.
        skipped: a 16-mixed step skipped for an inf or NaN gradient (a 0-d bool tensor), or
            None without a ``GradScaler``.
        lr: the first parameter group's learning rate the step used, or None before a step.
        steps: optimizer steps taken by this update.
    """

    def __init__(self) -> None:
        self.grad_norm: torch.Tensor | None = None
        self.found_inf: dict[Any, torch.Tensor] = {}  # the scaler's, per device, kept as is
        self.lr: float | None = None
        self.steps = 0

    @property
    def skipped(self) -> torch.Tensor | None:
        """Whether the last 16-mixed step was skipped (summed when read: no op per step)."""
        found = list(self.found_inf.values())
        return torch.stack([f.to(found[0].device) for f in found]).sum() > 0 if found else None


class Update:
    """Zero, reduce, step and broadcast, bound once per call (see the module docstring).

    Args:
        flat: the gradient buckets of several replicas (or ranks), or None (one replica:
            its gradients are set to None before backward, as ``optimizer.zero_grad()``).
        masters: device 0's trainable parameters (the optimizer's).
        options: the optimizer, scaler and clipping (None: an update that only zeroes).
        engine: the call's engine: its ``reduce`` sums device 0's gradients across ranks
            (where it ``reduces`` and ``options.cross_rank``), its ``step`` steps the
            optimizer (where it defines ``step``); None: neither.
        before_step: callables run before each optimizer step (the manager's list, which a
            call fills while an async save copies the weights); read at every step.

    Example:
        >>> a, b = nn.Linear(3, 2), nn.Linear(3, 2)
        >>> opt = torch.optim.SGD(a.parameters(), lr=0.1)
        >>> up = Update(FlatBuckets([list(a.parameters()), list(b.parameters())]),
        ...             list(a.parameters()), UpdateOptions(opt))
        >>> len(up.broadcast)  # device 0's flat parameters to device 1's
        1
    """

    def __init__(self, flat: FlatBuckets | None, masters: Sequence[nn.Parameter],
                 options: UpdateOptions | None = None, *, engine: Engine | None = None,
                 before_step: list[Callable[[], None]] | None = None) -> None:
        options = options if options is not None else UpdateOptions()
        self.flat = flat
        # What the step saw (``StepState``); the norm is taken when asked for or clipping.
        self.state = StepState()
        self.track_norm = options.track_norm
        self.inspect = options.inspect
        self.masters = list(masters)
        optimizer = options.optimizer
        self.optimizer, self.scaler, self.clip_norm = optimizer, options.scaler, \
            options.clip_norm
        self.cross_rank: Callable[[], None] | None = (
            engine.reduce if engine is not None and engine.reduces and options.cross_rank
            else None)
        # The engine's own optimizer step (None: ``optimizer.step()`` here, no call more).
        self.engine_step: Callable[[Update], None] | None = (
            getattr(engine, "step", None))
        self.before_step = before_step if before_step is not None else []
        self.size = param_count(optimizer) if optimizer is not None else 0
        # Clipping takes the norm of the gradients the optimizer steps: all of device 0's,
        # or, for one of several optimizers (``manual_update``), its own, in flat order.
        mine = {id(p) for g in optimizer.param_groups for p in g["params"]} \
            if optimizer is not None else set()
        clipped = [p for p in self.masters if id(p) in mine]
        self.clipped = self.masters if len(clipped) == len(self.masters) else clipped
        # (device 0's gradient range, the other devices' ranges) per bucket, and the same
        # for parameters the other way. Views made once: no per-step allocation.
        self.reduce: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        self.broadcast: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        if flat is not None:
            for b in range(len(flat.plan)):
                params = [p[b] for p in flat.param_flat]
                self.broadcast.append((params[0], params[1:]))
                if flat.grads:
                    grads = [g[b] for g in flat.grad_flat]
                    self.reduce.append((grads[0], grads[1:]))
        # Per device, the trainable parameters (fresh gradients, see above).
        self.params: list[list[nn.Parameter]] = (
            [list(ps) for ps in flat.params] if flat is not None else [self.masters])
        # What the reduce and the optimizer step run in: nothing here, a profiler's named
        # range in a ``NamedUpdate`` (a reusable context either way: no object per step).
        self.reduce_range: contextlib.AbstractContextManager[Any] = _NULL
        self.step_range: contextlib.AbstractContextManager[Any] = _NULL

    # -- what each device thread runs -----------------------------------------------------

    def zero_device(self, d: int) -> None:
        """Device ``d``'s gradients: zeroed in place in their buckets, or (no gradient
        buckets, or one replica) set to None for backward to write anew."""
        flat = self.flat
        if flat is not None and flat.grads:
            flat.zero_device(d)
        else:
            for p in self.params[d]:
                p.grad = None

    def fits(self, optimizer: torch.optim.Optimizer | None) -> bool:
        """Whether this update still describes ``optimizer`` (the same parameter count)."""
        return optimizer is None or param_count(optimizer) == self.size

    def apply(self) -> None:
        """The optimizer step: the ``before_step`` hooks, reduce, (unscale, clip), step,
        broadcast. Runs on the caller once every device's backward has ended without
        error, so a failing device leaves every parameter as it was."""
        for hook in self.before_step:
            hook()
        self.reduce_gradients()
        optimizer, scaler = self.optimizer, self.scaler
        if optimizer is None:
            return  # an update that only zeroes
        state = self.state
        if scaler is not None:
            scaler.unscale_(optimizer)
            state.found_inf = scaler._found_inf_per_device(optimizer)  # noqa: SLF001
        if self.inspect is not None:  # on_before_optimizer_step: reduced and unscaled
            self.inspect(optimizer)
        if self.clip_norm is not None:  # its total is the norm before clipping
            state.grad_norm = torch.nn.utils.clip_grad_norm_(self.clipped, self.clip_norm)
        elif self.track_norm:
            state.grad_norm = torch.nn.utils.get_total_norm(
                [p.grad for p in self.clipped if p.grad is not None])
        state.lr = optimizer.param_groups[0].get("lr")  # (an optimizer may have none)
        state.steps += 1
        with self.step_range:  # the executor's one call of the optimizer's step
            if self.engine_step is not None:
                self.engine_step(self)
            elif scaler is None:
                optimizer.step()  # (looked up: an LR scheduler made later wraps it)
            else:
                scaler.step(optimizer)
                scaler.update()
        self.broadcast_params()

    def reduce_gradients(self) -> None:
        """Every device's gradients summed into device 0's (then across the ranks); the
        other devices' are zeroed (or dropped), so each backward counts once however often
        the reduce is asked."""
        flat = self.flat
        with self.reduce_range:
            if flat is None:
                pass  # one replica: nothing to add
            elif not flat.grads:  # fresh gradients: added in device order, then dropped
                params = self.params
                acc = list(map(_GRAD, params[0]))
                for ps in params[1:]:
                    if acc:
                        try:
                            torch._foreach_add_(acc, list(map(_GRAD, ps)))  # type: ignore[arg-type]
                        except TypeError:  # a None (rare: looking first would cost every step)
                            acc = _add_with_missing(params[0], ps)
                    for p in ps:
                        p.grad = None
            else:
                for acc_flat, others in self.reduce:
                    add_into(acc_flat, others)
            if self.cross_rank is not None:
                self.cross_rank()

    def broadcast_params(self) -> None:
        """Device 0's parameters copied to every other device."""
        for src, dsts in self.broadcast:
            for dst in dsts:
                dst.copy_(src, non_blocking=True)


def _add_with_missing(lead: list[nn.Parameter], other: list[nn.Parameter]
                      ) -> list[torch.Tensor | None]:
    """``other``'s fresh gradients added into ``lead``'s where some are None (a parameter
    backward left without a gradient counts as zeros, as in the zeroed buckets; an optimizer
    skips a parameter without one); returns ``lead``'s gradients. A None fails
    ``_foreach_add_`` before any addition, so nothing was added yet."""
    if all(p.grad is None for p in other):
        return [p.grad for p in lead]  # added and dropped already (a second reduce)
    for p in lead + other:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    acc = [p.grad for p in lead]
    torch._foreach_add_(acc, [p.grad for p in other])  # type: ignore[arg-type, misc]
    return acc


class NamedUpdate(Update):
    """An ``Update`` whose reduce and optimizer step are named ranges (``fitdp.reduce``,
    ``fitdp.step``) in a profiler's trace: bound for a call that a profiler records."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reduce_range = torch.profiler.record_function("fitdp.reduce")
        self.step_range = torch.profiler.record_function("fitdp.step")


def param_count(optimizer: torch.optim.Optimizer) -> int:
    """How many parameters ``optimizer`` steps (a changed count: a new plan)."""
    return sum(len(g["params"]) for g in optimizer.param_groups)
