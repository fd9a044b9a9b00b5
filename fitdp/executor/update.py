"""The optimizer update of a training step, the one place the executor steps an optimizer.

An ``Update`` is bound once per call from what the call fixes (optimizer, ``GradScaler``,
clipping norm, the flat gradient buckets, the cross-rank reduction); the bound step runs
``apply`` on a batch that ends with an optimizer step (an update without an optimizer only
zeroes). Its parts run in order:

- ``zero_device(d)``: device ``d``'s gradients zeroed, on its thread, before its backward
  (the batch that starts an optimizer step);
- ``apply()``: the ``before_step`` hooks (an async save still copying the weights waits
  there), the gradients summed over the devices into device 0's (then across ranks:
  ``cross_rank``, the engine's ``reduce``), unscaled and clipped, the optimizer step, and
  device 0's parameters copied to every other device.

On CPU replicas without ranks the buckets hold no gradients (``FlatBuckets`` says why: a
replica then holds its weights and gradients once each): backward writes fresh gradients after
the zeroing sets them to None, as a hand-written loop's ``zero_grad()`` does, and the reduce
adds them with one ``torch._foreach_add_`` per device, then drops the other devices' (so each
backward counts once however often the reduce is asked).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from fitdp.executor.flat_buckets import FlatBuckets, add_into


class Update:
    """Zero, reduce, step and broadcast, bound once per call (see the module docstring).

    Args:
        flat: the gradient buckets of several replicas (or ranks), or None (one replica:
            its gradients are set to None before backward, as ``optimizer.zero_grad()``).
        masters: device 0's trainable parameters (the optimizer's).
        optimizer: what steps them (None: an update that only zeroes).
        scaler: the ``GradScaler`` of a 16-mixed run, or None.
        clip_norm: max global norm of the gradients, or None.
        cross_rank: sums device 0's gradients across ranks (the engine's ``reduce``; None:
            nothing left to the step).
        before_step: callables run before each optimizer step (the manager's list, which a
            call fills while an async save copies the weights); read at every step.

    Example:
        >>> a, b = nn.Linear(3, 2), nn.Linear(3, 2)
        >>> opt = torch.optim.SGD(a.parameters(), lr=0.1)
        >>> up = Update(FlatBuckets([list(a.parameters()), list(b.parameters())]),
        ...             list(a.parameters()), opt)
        >>> len(up.broadcast)  # device 0's flat parameters to device 1's
        1
    """

    def __init__(self, flat: FlatBuckets | None, masters: Sequence[nn.Parameter],
                 optimizer: torch.optim.Optimizer | None, *,
                 scaler: torch.amp.GradScaler | None = None, clip_norm: float | None = None,
                 cross_rank: Callable[[], None] | None = None,
                 before_step: list[Callable[[], None]] | None = None) -> None:
        self.flat = flat
        self.masters = list(masters)
        self.optimizer, self.scaler, self.clip_norm = optimizer, scaler, clip_norm
        self.cross_rank = cross_rank
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
        self._step = self._bind_step()

    def _bind_step(self) -> Callable[[], None]:
        """The optimizer step, chosen once: the scaler's, or the optimizer's own
        (``optimizer.step()``: the executor's one call of it)."""
        optimizer, scaler = self.optimizer, self.scaler
        if optimizer is None:
            return lambda: None
        if scaler is not None:
            def scaled() -> None:
                scaler.step(optimizer)
                scaler.update()
            return scaled
        # Looked up per step: an LR scheduler made later wraps the instance's ``step``.
        return lambda: optimizer.step()  # type: ignore[func-returns-value]

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
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # type: ignore[arg-type]
        if self.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.clipped, self.clip_norm)
        self._step()
        self.broadcast_params()

    def reduce_gradients(self) -> None:
        """Every device's gradients summed into device 0's (then across the ranks); the
        other devices' are zeroed (or dropped), so each backward counts once however often
        the reduce is asked."""
        if self.flat is None:
            pass  # one replica: nothing to add
        elif not self.flat.grads:
            self._add_fresh(self.params)
            for ps in self.params[1:]:
                for p in ps:
                    p.grad = None
        else:
            for acc, others in self.reduce:
                add_into(acc, others)
        if self.cross_rank is not None:
            self.cross_rank()

    def broadcast_params(self) -> None:
        """Device 0's parameters copied to every other device."""
        for src, dsts in self.broadcast:
            for dst in dsts:
                dst.copy_(src, non_blocking=True)

    @staticmethod
    def _add_fresh(devices: list[list[nn.Parameter]]) -> None:
        """Add the other devices' fresh gradients of these parameters into device 0's, in
        device order. A parameter backward left without a gradient counts as zeros, as in
        the zeroed buckets (an optimizer skips a parameter without one)."""
        acc = [p.grad for p in devices[0]]
        if not acc:
            return
        for ps in devices[1:]:
            try:
                torch._foreach_add_(acc, [p.grad for p in ps])  # type: ignore[arg-type, misc]
            except TypeError:  # a None (rare: looking for one first would cost every step)
                if all(p.grad is None for p in ps):
                    continue  # added and dropped already (a second reduce): nothing to add
                # A None fails before any addition; the devices before this one are added.
                for p in devices[0] + ps:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                acc = [p.grad for p in devices[0]]
                torch._foreach_add_(acc, [p.grad for p in ps])  # type: ignore[arg-type, misc]


class NamedUpdate(Update):
    """An ``Update`` whose reduce and optimizer step are named ranges (``fitdp.reduce``,
    ``fitdp.step``) in a profiler's trace: bound for a call that a profiler records."""

    def _bind_step(self) -> Callable[[], None]:
        step = super()._bind_step()

        def ranged() -> None:
            with torch.profiler.record_function("fitdp.step"):
                step()

        return ranged

    def reduce_gradients(self) -> None:
        with torch.profiler.record_function("fitdp.reduce"):
            super().reduce_gradients()


def param_count(optimizer: torch.optim.Optimizer) -> int:
    """How many parameters ``optimizer`` steps (a changed count: a new plan)."""
    return sum(len(g["params"]) for g in optimizer.param_groups)
