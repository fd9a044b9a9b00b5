"""The optimizer update of a training step, the one place the executor steps an optimizer.

An ``Update`` is bound once per call from what the call fixes (optimizer, ``GradScaler``,
clipping norm, the flat gradient buckets, the cross-rank reduction, whether the step is split
over the CPU replica threads) and then only told, per batch, whether this batch zeroes the
gradients first and whether it ends with a step (``prepare``). Its parts run in order:

- ``zero_device(d)``: device ``d``'s gradients zeroed, on its thread, before its backward
  (``zero``: the batch that starts an optimizer step);
- ``apply(s)``: shard ``s``'s gradients summed over the devices into device 0's (then across
  ranks: ``cross_rank``, the engine's ``reduce``), unscaled and clipped (unsharded only),
  the optimizer step, and device 0's parameters of the shard copied to every other device.

Sharded (several CPU replicas, ``SHARD_MIN_NUMEL`` elements or more, an optimizer of
``SHARDABLE``, no scaler, clipping or ranks), shard ``s`` runs on device thread ``s`` once
every device has arrived (``arrive``, ``finish``); otherwise ``finish_all`` runs the one shard
on the caller after the hand-off. Either way the numbers are those of one whole step: the same
additions in the same order, and an optimizer step that reads only its parameters' gradients
and state.

On CPU replicas without ranks the buckets hold no gradients (``FlatBuckets`` says why: a
replica then holds its weights and gradients once each): backward writes fresh gradients after
the zeroing sets them to None, as a hand-written loop's ``zero_grad()`` does, and the reduce
adds them with one ``torch._foreach_add_`` per shard and device, then drops the other devices'
(so each backward counts once however often the reduce is asked). This also spares a memset
and an addition over every gradient per device (measured, whole steps on two CPU replicas,
fresh against zeroed buckets: MLP 1024-1024-1024-10 19.18 ms against 19.15 and 19.51 in two
runs, MLP 128-128-128-10 0.589 against 0.602).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence

import torch
from torch import nn

from fitdp.executor import fence
from fitdp.executor.flat_buckets import FlatBuckets, add_into
from fitdp.executor.sharded_step import ShardedStep, param_count

# Below this many trainable elements the whole update runs on device 0's thread: splitting
# it costs a wait for every thread and Python-level contention for the GIL, more than the
# arithmetic saved (measured, Adam, two CPU replicas, whole steps: MLP 128-128-128-10 (35k
# elements) 0.82 ms split against 0.57 whole; MLP 1024-1024-1024-10 (2.1M) 18.97 against
# 19.52).
SHARD_MIN_NUMEL = 1 << 18


class Update:
    """Zero, reduce, step and broadcast, bound once per call (see the module docstring).

    Args:
        flat: the gradient buckets of several replicas (or ranks), or None (one replica:
            its gradients are set to None before backward, as ``optimizer.zero_grad()``).
        masters: device 0's trainable parameters (the optimizer's).
        optimizer: what steps them (None: an update that only zeroes).
        shards: threads that share the step (1: one thread does all of it).
        scaler: the ``GradScaler`` of a 16-mixed run, or None.
        clip_norm: max global norm of the gradients, or None.
        cross_rank: sums device 0's gradients across ranks (the engine's ``reduce``; None:
            nothing left to the step).

    Example:
        >>> a, b = nn.Linear(3, 2), nn.Linear(3, 2)
        >>> opt = torch.optim.SGD(a.parameters(), lr=0.1)
        >>> up = Update(FlatBuckets([list(a.parameters()), list(b.parameters())]),
        ...             list(a.parameters()), opt, shards=2)
        >>> [len(r) for r in up.reduce]  # weight on device 0's thread, bias on device 1's
        [1, 1]
    """

    def __init__(self, flat: FlatBuckets | None, masters: Sequence[nn.Parameter],
                 optimizer: torch.optim.Optimizer | None, shards: int = 1, *,
                 scaler: torch.amp.GradScaler | None = None, clip_norm: float | None = None,
                 cross_rank: Callable[[], None] | None = None) -> None:
        self.flat = flat
        self.masters = list(masters)
        self.optimizer, self.scaler, self.clip_norm = optimizer, scaler, clip_norm
        self.cross_rank = cross_rank
        self.devices = len(flat.params) if flat is not None else 1
        self.shards = max(1, min(shards, self.devices))
        self.size = param_count(optimizer) if optimizer is not None else 0
        # Clipping takes the norm of the gradients the optimizer steps: all of device 0's,
        # or, for one of several optimizers (``manual_update``), its own, in flat order.
        mine = {id(p) for g in optimizer.param_groups for p in g["params"]} \
            if optimizer is not None else set()
        clipped = [p for p in self.masters if id(p) in mine]
        self.clipped = self.masters if len(clipped) == len(self.masters) else clipped
        owner = self.owner = self._owners()
        # Per shard: (device 0's gradient range, the other devices' ranges), and the same for
        # parameters the other way. Views made once: no per-step allocation.
        self.reduce: list[list[tuple[torch.Tensor, list[torch.Tensor]]]] = [
            [] for _ in range(self.shards)]
        self.broadcast: list[list[tuple[torch.Tensor, list[torch.Tensor]]]] = [
            [] for _ in range(self.shards)]
        if flat is not None:
            self._ranges(flat, owner)
        # Per shard and device, the shard's parameters (fresh gradients, see above).
        self.params: list[list[list[nn.Parameter]]] = [
            [[ps[k] for k, o in enumerate(owner) if o == s] for ps in flat.params]
            for s in range(self.shards)] if flat is not None else [[self.masters]]
        self.arrived = [threading.Event() for _ in range(self.devices)]
        self.ok = [False] * self.devices
        self.zero = False
        self.stepping = False  # this batch ends with the optimizer step
        self._step_shard = self._bind_step()
        # Decided once: one replica in one process has nothing to reduce or broadcast
        # (two calls fewer per step; they add up on a tiny model).
        self._reduces = flat is not None or cross_rank is not None
        self._broadcasts = any(self.broadcast)

    def _owners(self) -> list[int]:
        """The shard of each trainable parameter: contiguous in flat order, balanced by size."""
        sizes = [p.numel() for p in self.masters]
        total = max(sum(sizes), 1)
        owner, start = [], 0
        for n in sizes:
            owner.append(min(self.shards - 1, (2 * start + n) * self.shards // (2 * total)))
            start += n
        return owner

    def _ranges(self, flat: FlatBuckets, owner: list[int]) -> None:
        for b, ks in enumerate(flat.plan):
            offset, spans = 0, dict[int, tuple[int, int]]()
            for k in ks:
                lo, hi = spans.get(owner[k], (offset, offset))
                spans[owner[k]] = (lo, hi + self.masters[k].numel())
                offset += self.masters[k].numel()
            for s, (lo, hi) in spans.items():
                params = [p[b][lo:hi] for p in flat.param_flat]
                self.broadcast[s].append((params[0], params[1:]))
                if flat.grads:
                    grads = [g[b][lo:hi] for g in flat.grad_flat]
                    self.reduce[s].append((grads[0], grads[1:]))

    def _bind_step(self) -> Callable[[int], None]:
        """The optimizer step of one shard, chosen once: the scaler's, the sharded one, or
        the optimizer's own (``optimizer.step()``: the executor's one call of it)."""
        optimizer, scaler = self.optimizer, self.scaler
        if optimizer is None:
            return lambda s: None
        if scaler is not None:
            def scaled(s: int) -> None:
                scaler.step(optimizer)
                scaler.update()
            return scaled
        if self.shards > 1:
            owner = {id(p): s for p, s in zip(self.masters, self.owner)}
            return ShardedStep(optimizer, self.shards, owner).step_shard
        return lambda s: optimizer.step()  # type: ignore[func-returns-value]

    def prepare(self, zero: bool, step: bool) -> bool:
        """This batch: zero the gradients first (``zero``), and step at the end (``step``).
        Returns whether it steps (``stepping``)."""
        self.zero = zero
        stepping = self.stepping = step and self.optimizer is not None
        if stepping and self.shards > 1:
            for event in self.arrived:
                event.clear()
        return stepping

    # -- what each device thread runs -----------------------------------------------------

    def zero_device(self, d: int) -> None:
        """Device ``d``'s gradients: zeroed in place in their buckets, or (no gradient
        buckets, or one replica) set to None for backward to write anew."""
        flat = self.flat
        if flat is None:
            for p in self.masters:
                p.grad = None
        else:
            flat.zero_device(d)

    def arrive(self, d: int, ok: bool) -> None:
        """Device ``d``'s backward is over (``ok``: without error)."""
        if self.stepping and self.shards > 1:
            self.ok[d] = ok
            self.arrived[d].set()

    def finish(self, d: int) -> None:
        """Sharded: once every device has arrived without error, device ``d``'s shard. A
        device that failed leaves every parameter as it was."""
        if not self.stepping or self.shards == 1 or d >= self.shards:
            return
        for event in self.arrived:
            event.wait()
        if all(self.ok):
            self.apply(d)

    def finish_all(self) -> None:
        """Every shard on this thread (every device's share ended without error)."""
        if self.stepping:
            for s in range(self.shards):  # one, unless a serial batch of a sharded update
                self.apply(s)

    def step_all(self, run: Callable[[list[Callable[[], None]]], object]) -> None:
        """The step alone, after the batches' backwards (``manager.step``): every shard,
        shard s on device thread s through ``run`` (``DeviceWorkers.run``) when sharded."""
        self.prepare(False, True)
        if self.stepping:
            run([functools.partial(self.apply, s) for s in range(self.shards)])

    def fits(self, optimizer: torch.optim.Optimizer | None) -> bool:
        """Whether this update still describes ``optimizer`` (the same parameter count)."""
        return optimizer is None or param_count(optimizer) == self.size

    def apply(self, s: int) -> None:
        """Shard ``s``: reduce, (unscale, clip), step, broadcast."""
        if fence.pending:  # an async save is still copying the weights it steps
            fence.wait_for_snapshots()
        if self._reduces:
            self.reduce_shard(s)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # type: ignore[arg-type]
        if self.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.clipped, self.clip_norm)
        self._step_shard(s)
        if self._broadcasts:
            self.broadcast_shard(s)

    def reduce_shard(self, s: int) -> None:
        """Shard ``s``'s gradients of every device summed into device 0's (then across the
        ranks); the other devices' are zeroed (or dropped), so each backward counts once
        however often the reduce is asked."""
        if self.flat is None:
            pass  # one replica: nothing to add
        elif not self.flat.grads:
            self._add_fresh(self.params[s])
            for ps in self.params[s][1:]:
                for p in ps:
                    p.grad = None
        else:
            for acc, others in self.reduce[s]:
                add_into(acc, others)
        if self.cross_rank is not None:
            self.cross_rank()

    def broadcast_shard(self, s: int) -> None:
        """Device 0's parameters of shard ``s`` copied to every other device."""
        for src, dsts in self.broadcast[s]:
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

    def _bind_step(self) -> Callable[[int], None]:
        step = super()._bind_step()

        def ranged(s: int) -> None:
            with torch.profiler.record_function("fitdp.step"):
                step(s)

        return ranged

    def reduce_shard(self, s: int) -> None:
        with torch.profiler.record_function("fitdp.reduce"):
            super().reduce_shard(s)
