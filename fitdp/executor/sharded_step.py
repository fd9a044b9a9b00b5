"""The optimizer's own ``step`` split into shards of its parameters, one per CPU replica
thread (``ShardedStep``); ``fitdp.executor.update.Update`` runs one shard per thread."""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch

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
        shards: how many shards (``step_shard(s)`` steps shard s, on any thread).
        owner: ``id(parameter) -> shard`` (default: largest parameters first, each to the
            lightest shard); parameters it does not name go to shard 0.

    Example:
        >>> net = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> ShardedStep.supports(opt)
        True
    """

    def __init__(self, optimizer: torch.optim.Optimizer, shards: int,
                 owner: Mapping[int, int] | None = None) -> None:
        self.optimizer = optimizer
        self.shards = shards
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


def param_count(optimizer: torch.optim.Optimizer) -> int:
    """How many parameters ``optimizer`` steps (a changed count: a new plan)."""
    return sum(len(g["params"]) for g in optimizer.param_groups)
