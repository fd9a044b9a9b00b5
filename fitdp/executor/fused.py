"""A training batch's gradient zeroing and optimizer update, done by the device threads inside
the batch's one hand-off (``DataParallelExecutorManager.run_batch``).

Each device thread clears its own gradients before its backward; after every backward has
arrived, each thread reduces, steps and broadcasts its own shard of the parameters (one
contiguous range of the flat buckets). The numbers are those of ``manager.step``: the same
additions in the same order, and an optimizer step that reads only its parameters' gradients
and state.

On a batch that both starts and ends an optimizer step (no gradient accumulation), the
gradients are set to None instead of zeroed, so backward writes fresh ones (as a hand-written
loop's ``zero_grad()`` does) rather than adding into the zeroed buckets: a memset and an
addition over every gradient less per device (measured, whole steps on two CPU replicas, fresh
against zeroed: MLP 1024-1024-1024-10 19.18 ms against 19.15 and 19.51 in two runs, MLP
128-128-128-10 0.589 against 0.602). They are then added with one ``torch._foreach_add_`` per
shard and device; the buckets take the gradients again at the next zeroing
(``FlatBuckets.zero_device``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
from torch import nn

from fitdp.executor.reduce import FlatBuckets
from fitdp.executor.step import ShardedStep

# Below this many trainable elements the whole update runs on device 0's thread: splitting
# it costs a wait for every thread and Python-level contention for the GIL, more than the
# arithmetic saved (measured, Adam, two CPU replicas, whole steps: MLP 128-128-128-10 (35k
# elements) 0.82 ms split against 0.57 whole; MLP 1024-1024-1024-10 (2.1M) 18.97 against
# 19.52).
SHARD_MIN_NUMEL = 1 << 18


class FusedUpdate:
    """Zero, reduce, step and broadcast, split over the device threads.

    Args:
        flat: the gradient buckets of several replicas, or None (one replica: its gradients
            are set to None before backward, as ``optimizer.zero_grad()`` does).
        masters: device 0's trainable parameters (the optimizer's).
        shards: threads that share the update (1: device 0 does all of it).

    Example:
        >>> a, b = nn.Linear(3, 2), nn.Linear(3, 2)
        >>> up = FusedUpdate(FlatBuckets([list(a.parameters()), list(b.parameters())]),
        ...                  list(a.parameters()), shards=2)
        >>> [len(r) for r in up.reduce]  # weight on device 0's thread, bias on device 1's
        [1, 1]
    """

    def __init__(self, flat: FlatBuckets | None, masters: Sequence[nn.Parameter],
                 shards: int) -> None:
        self.flat = flat
        self.masters = list(masters)
        self.devices = len(flat.params) if flat is not None else 1
        self.shards = max(1, min(shards, self.devices))
        owner = self._owners()
        self.owner = owner
        # Per shard: (device 0's gradient range, the other devices' ranges), and the same for
        # parameters the other way. Views made once: no per-step allocation.
        self.reduce: list[list[tuple[torch.Tensor, list[torch.Tensor]]]] = [
            [] for _ in range(self.shards)]
        self.broadcast: list[list[tuple[torch.Tensor, list[torch.Tensor]]]] = [
            [] for _ in range(self.shards)]
        if flat is not None:
            self._ranges(flat, owner)
        # Per shard and device, the shard's parameters (for fresh gradients, see above).
        self.params: list[list[list[nn.Parameter]]] = [
            [[ps[k] for k, o in enumerate(owner) if o == s] for ps in flat.params]
            for s in range(self.shards)] if flat is not None else [[self.masters]]
        self.device_params = [list(ps) for ps in flat.params] if flat is not None else []
        self.arrived = [threading.Event() for _ in range(self.devices)]
        self.ok = [False] * self.devices
        self.zero = False
        self.fresh = False  # this batch's backward writes new gradients (set to None first)
        self.optimizer: torch.optim.Optimizer | None = None
        self._sharded: ShardedStep | None = None
        self._lock = threading.Lock()

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
                grads = [g[b][lo:hi] for g in flat.grad_flat]
                params = [p[b][lo:hi] for p in flat.param_flat]
                self.reduce[s].append((grads[0], grads[1:]))
                self.broadcast[s].append((params[0], params[1:]))

    def prepare(self, zero: bool, optimizer: torch.optim.Optimizer | None) -> None:
        """This batch: zero the gradients first (``zero``), and step ``optimizer`` at the end
        (None: accumulate only)."""
        self.zero, self.optimizer = zero, optimizer
        self.fresh = zero and optimizer is not None
        if optimizer is not None and self.devices > 1:
            for event in self.arrived:
                event.clear()

    # -- what each device thread runs -----------------------------------------------------

    def before(self, d: int) -> None:
        """Before device ``d``'s backward: its gradients to zero (on the batch that starts an
        optimizer step)."""
        if not self.zero:
            return
        flat = self.flat
        if flat is None:
            for p in self.masters:
                p.grad = None
        elif self.fresh:
            for p in self.device_params[d]:
                p.grad = None
        else:
            flat.zero_device(d)

    def arrive(self, d: int, ok: bool) -> None:
        """Device ``d``'s backward is over (``ok``: without error)."""
        if self.optimizer is not None:
            self.ok[d] = ok
            self.arrived[d].set()

    def finish(self, d: int) -> None:
        """Once every device has arrived without error: reduce, step and broadcast device
        ``d``'s shard. A device that failed leaves every parameter as it was."""
        if self.optimizer is None or d >= self.shards:
            return
        for event in self.arrived:
            event.wait()
        if all(self.ok):
            self._apply(d)

    def finish_all(self) -> None:
        """Every shard's part on this thread (every device's share ran here, without error)."""
        if self.optimizer is not None:
            for d in range(self.shards):
                self._apply(d)

    def _apply(self, d: int) -> None:
        optimizer = self.optimizer
        assert optimizer is not None  # noqa: S101 - callers check
        if self.flat is None:
            pass  # one replica: nothing to add or copy
        elif self.fresh:
            self._add_fresh(self.params[d])
        else:
            for acc, others in self.reduce[d]:
                for g in others:
                    acc.add_(g)
        if self.shards == 1:
            optimizer.step()
        else:
            self._sharded_step(optimizer).step_shard(d)
        for src, dsts in self.broadcast[d]:
            for dst in dsts:
                dst.copy_(src)

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
                # A None fails before any addition; the devices before this one are added.
                for p in devices[0] + ps:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                acc = [p.grad for p in devices[0]]
                torch._foreach_add_(acc, [p.grad for p in ps])  # type: ignore[arg-type, misc]

    def _sharded_step(self, optimizer: torch.optim.Optimizer) -> ShardedStep:
        """The optimizer split along this update's shards (made once per optimizer)."""
        sharded = self._sharded
        if sharded is None or not sharded.fits(optimizer):
            with self._lock:  # the first step: every thread asks at once
                sharded = self._sharded
                if sharded is None or not sharded.fits(optimizer):
                    owner = {id(p): s for p, s in zip(self.masters, self.owner)}
                    sharded = self._sharded = ShardedStep(optimizer, None, self.shards, owner)
        return sharded
