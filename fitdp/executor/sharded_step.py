"""One optimizer step split over the device threads (several replicas on the CPU)."""

from __future__ import annotations

import copy
import functools

import torch

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

    Example:
        >>> net = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> ShardedStep.supports(opt)
        True
    """

    def __init__(self, optimizer: torch.optim.Optimizer, workers: DeviceWorkers, shards: int):
        self.optimizer = optimizer
        self.workers = workers
        params = [p for g in optimizer.param_groups for p in g["params"]]
        loads = [0] * shards
        self.owner: dict[int, int] = {}
        for p in sorted(params, key=lambda p: -p.numel()):  # largest first, to the lightest
            shard = loads.index(min(loads))
            self.owner[id(p)] = shard
            loads[shard] += p.numel()
        self.shards = shards

    @staticmethod
    def supports(optimizer: torch.optim.Optimizer) -> bool:
        return type(optimizer) in SHARDABLE

    def step(self) -> None:
        opt = self.optimizer
        views = []
        for shard in range(self.shards):
            view = copy.copy(opt)  # shares state, defaults and hooks; own param_groups
            view.param_groups = [
                {**g, "params": [p for p in g["params"] if self.owner[id(p)] == shard]}
                for g in opt.param_groups
            ]
            views.append(view)
        step = type(opt).step  # the class's step: an LR scheduler patches the instance's
        self.workers.run([functools.partial(step, v) for v in views])
        # What a scheduler's patched ``opt.step`` records, so it does not warn of a skipped step.
        opt._opt_called = True  # type: ignore[attr-defined]
