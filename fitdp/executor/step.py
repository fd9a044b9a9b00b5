"""The optimizer step of the data-parallel layer: reduce, unscale, clip, step, broadcast.

``DataParallelExecutorManager.step`` (from ``OptimizerStepMixin``) runs it; with several CPU
replicas the optimizer's own ``step`` is split over the device threads (``ShardedStep``).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from fitdp.executor.interrupts import GUARD
from fitdp.executor.reduce import FlatBuckets
from fitdp.executor.workers import DeviceWorkers

# Optimizers whose update of a parameter reads only that parameter's gradient and state, so
# stepping disjoint subsets of the parameters gives exactly the full step.
SHARDABLE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop,
    torch.optim.Adagrad, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
)


class ShardedStep:
    """Step ``optimizer`` as one shard of its parameters per device thread.

    After backward only device 0's thread works (reduce, step, broadcast) while the other
    replicas' cores idle; the optimizer step is the largest part of that. Each thread runs the
    optimizer's own ``step`` on a shallow copy that sees only its shard (parameters balanced by
    size) and shares the optimizer's state dict, so the result is the full step, bit for bit.

    Args:
        optimizer: one of ``SHARDABLE``.
        workers: the device threads (``step`` runs shard s on thread s).
        shards: how many shards.
        owner: ``id(parameter) -> shard`` (default: largest parameters first, each to the
            lightest shard); parameters it does not name go to shard 0.

    Example:
        >>> net = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> ShardedStep.supports(opt)
        True
    """

    def __init__(self, optimizer: torch.optim.Optimizer, workers: DeviceWorkers | None,
                 shards: int, owner: Mapping[int, int] | None = None) -> None:
        self.optimizer = optimizer
        self.workers = workers
        self.shards = shards
        self.size = _param_count(optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if owner is None:
            loads = [0] * shards
            owner = {}
            for p in sorted(params, key=lambda p: -p.numel()):  # largest first, to the lightest
                shard = loads.index(min(loads))
                owner[id(p)] = shard
                loads[shard] += p.numel()
        # Per shard and group, the parameters it steps: computed once, not per step.
        groups = optimizer.param_groups
        self.parts = [[[p for p in g["params"] if owner.get(id(p), 0) == s] for g in groups]
                      for s in range(shards)]
        # Each shard's view: made once, refreshed per step (see ``view``).
        self.views = [copy.copy(optimizer) for _ in range(shards)]
        for view, part in zip(self.views, self.parts):
            view.param_groups = [{**g, "params": ps} for g, ps in zip(groups, part)]

    @staticmethod
    def supports(optimizer: torch.optim.Optimizer) -> bool:
        return type(optimizer) in SHARDABLE

    def fits(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether this plan still describes ``optimizer`` (same object, same parameters)."""
        return optimizer is self.optimizer and _param_count(optimizer) == self.size

    def view(self, shard: int) -> torch.optim.Optimizer:
        """The optimizer as shard ``shard`` sees it: its parameters only, everything else the
        optimizer's own as it is now (state, hooks, hyperparameters), so a scheduler's new
        rate or a loaded state dict is seen: the attributes and groups are refreshed from
        the optimizer on every call (cheaper than a new shallow copy per step)."""
        view, opt = self.views[shard], self.optimizer
        groups = view.param_groups
        view.__dict__.update(opt.__dict__)
        for vg, g, ps in zip(groups, opt.param_groups, self.parts[shard]):
            vg.update(g)
            vg["params"] = ps
        view.param_groups = groups
        return view

    def step_shard(self, shard: int) -> None:
        """Step the parameters of shard ``shard`` (on any thread; shards are disjoint)."""
        # The class's step: an LR scheduler patches the instance's.
        type(self.optimizer).step(self.view(shard))
        # What a scheduler's patched ``opt.step`` records, so it does not warn of a skipped step.
        self.optimizer._opt_called = True  # type: ignore[attr-defined]

    def step(self) -> None:
        """Every shard at once, shard s on device thread s."""
        assert self.workers is not None  # noqa: S101 - built with workers for this use
        self.workers.run([functools.partial(self.step_shard, s) for s in range(self.shards)])


def _param_count(optimizer: torch.optim.Optimizer) -> int:
    return sum(len(g["params"]) for g in optimizer.param_groups)



class OptimizerStepMixin:
    """The manager's optimizer step: gradients of the trainable parameters and one update.

    Mixed into ``DataParallelExecutorManager`` (kept here to keep one file per job); it reads
    the manager's ``devices``, ``workers``, ``distributed``, ``flat`` (the gradient buckets),
    ``param_names``, ``param_arrays`` and ``trainable``.
    """

    devices: list[torch.device]
    workers: DeviceWorkers
    distributed: bool
    flat: FlatBuckets | None
    trainable: list[bool]
    _sharded: ShardedStep | None

    if TYPE_CHECKING:  # the manager's properties
        @property
        def param_names(self) -> list[str]: ...

        @property
        def param_arrays(self) -> list[list[torch.nn.Parameter]]: ...

    def named_master_parameters(self) -> dict[str, torch.nn.Parameter]:
        """Device 0's parameters by name, frozen ones too: bind the optimizer to these."""
        return {name: block[0] for name, block in zip(self.param_names, self.param_arrays)}

    def master_parameters(self) -> list[torch.nn.Parameter]:
        """Device 0's trainable parameters: the ones the optimizer steps."""
        return [block[0] for block, on in zip(self.param_arrays, self.trainable) if on]

    def zero_grad(self) -> None:
        """Zero the gradients on every device."""
        if self.flat is not None:
            self.flat.zero_grad()
        else:
            for p in self.master_parameters():
                p.grad = None

    def reduce_gradients(self) -> None:
        """Sum every device's gradients into device 0's (then across ranks)."""
        if self.flat is not None:
            self.flat.reduce_local()
            if self.distributed:
                self.flat.reduce_global(None)

    def sync_params(self) -> None:
        """After an optimizer step on device 0, copy its parameters to every other device."""
        if self.flat is not None:
            self.flat.broadcast_params()

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        scaler: torch.amp.GradScaler | None = None,
        clip_norm: float | None = None,
    ) -> None:
        """One optimizer step on every replica, from the gradients of the last backward(s).

        The whole sequence, in order: reduce the gradients into device 0 (and across ranks);
        unscale them (``scaler``, 16-mixed); clip their global norm to ``clip_norm``; step
        ``optimizer`` on device 0's parameters (with several CPU replicas, split over the
        device threads: bit for bit the same update); copy device 0's parameters to every
        other device. A Ctrl-C during the sequence is raised after it, never between an
        update and its broadcast.

        Args:
            optimizer: built on ``named_master_parameters()`` (or ``master_parameters()``).
            scaler: the ``GradScaler`` of a 16-mixed run, or None.
            clip_norm: max global norm of the gradients, or None.
        """
        with GUARD.critical():
            self.reduce_gradients()
            if scaler is not None:
                scaler.unscale_(optimizer)
            if clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(self.master_parameters(), clip_norm)
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            elif (sharded := self._sharded_step(optimizer)) is not None:
                sharded.step()
            else:
                optimizer.step()
            self.sync_params()

    def _sharded_step(self, optimizer: torch.optim.Optimizer) -> ShardedStep | None:
        """The step split over the threads of several CPU replicas (None otherwise)."""
        if len(self.devices) < 2 or any(d.type != "cpu" for d in self.devices):
            return None
        if self._sharded is None or not self._sharded.fits(optimizer):
            if not ShardedStep.supports(optimizer):
                return None
            self._sharded = ShardedStep(optimizer, self.workers, len(self.devices))
        return self._sharded
