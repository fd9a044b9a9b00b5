"""The host module's tree, read in one walk: its submodules by name (their train/eval
modes), and from them its named parameters and buffers as ``named_parameters()`` and
``named_buffers()`` give them (the weights the replicas take and give back).

A call reads it once as it starts and once as it ends: each walk of a transformer's tree
costs tens of microseconds, and a call that walked it apart for each reader paid seven.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class HostTree:
    """``module``'s submodules, parameters and buffers, by name, as of one walk.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
        >>> tree = HostTree.read(net)
        >>> [name for name, _ in tree.modules], list(tree.params)
        (['', '0', '1'], ['0.weight', '0.bias', '1.weight', '1.bias'])
        >>> list(tree.buffers) == [name for name, _ in net.named_buffers()]
        True
    """

    modules: list[tuple[str, nn.Module]]
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]

    @classmethod
    def read(cls, module: nn.Module) -> HostTree:
        modules = list(module.named_modules())
        kind = type(module)
        if (kind.named_parameters is not nn.Module.named_parameters
                or kind.named_buffers is not nn.Module.named_buffers
                or kind._named_members is not nn.Module._named_members):  # noqa: SLF001
            # (a module that names its tensors its own way is asked)
            return cls(modules, dict(module.named_parameters()), dict(module.named_buffers()))
        return cls(modules, *_tensors(modules))


def _tensors(modules: list[tuple[str, nn.Module]]
             ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """torch's ``Module._named_members`` of parameters and of buffers, in one pass over the
    walk: each tensor once, under its first name; None entries skipped."""
    params: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    seen: tuple[set[int], set[int]] = (set(), set())
    for prefix, module in modules:
        dot = prefix + "." if prefix else ""
        for found, known, members in ((params, seen[0], module._parameters),  # noqa: SLF001
                                      (buffers, seen[1], module._buffers)):  # noqa: SLF001
            for name, tensor in members.items():
                if tensor is None or id(tensor) in known:
                    continue
                known.add(id(tensor))
                found[dot + name] = tensor
    return params, buffers
