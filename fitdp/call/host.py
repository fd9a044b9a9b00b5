"""The host module's tree, read in one walk: its submodules by name (their train/eval
modes), and from them its named parameters and buffers as ``named_parameters()`` and
``named_buffers()`` give them (the weights the replicas take and give back).

A call reads it once as it starts and once as it ends (and its first training pass sets
the replicas' modes with one more ``walk``): each walk of a small transformer's tree costs
20-60 us, and a fit that walked it apart for each reader walked it nine times.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

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
        modules = walk(module)
        kind = type(module)
        if (kind.named_parameters is not nn.Module.named_parameters
                or kind.named_buffers is not nn.Module.named_buffers
                or kind._named_members is not nn.Module._named_members):  # noqa: SLF001
            # (a module that names its tensors its own way is asked)
            return cls(modules, dict(module.named_parameters()), dict(module.named_buffers()))
        params: dict[str, torch.Tensor] = {}
        buffers: dict[str, torch.Tensor] = {}
        seen: tuple[set[int], set[int]] = (set(), set())
        for prefix, sub in modules:
            own = sub._parameters, sub._buffers  # noqa: SLF001
            if own[0]:
                _add(params, seen[0], own[0], prefix)
            if own[1]:
                _add(buffers, seen[1], own[1], prefix)
        return cls(modules, params, buffers)


def walk(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``list(module.named_modules())``, in its order and with its names, without its
    recursive generators (each submodule's name passes up through every level above it:
    a third of a call's fixed work on a transformer). A tree holding a module with its own
    ``named_modules`` is asked."""
    found: list[tuple[str, nn.Module]] = []
    seen: set[nn.Module] = set()  # (torch's memo: each module once, under its first name)
    stack = [("", module)]
    while stack:
        prefix, sub = stack.pop()
        if sub in seen:
            continue
        if type(sub).named_modules is not _NAMED_MODULES:
            return list(module.named_modules())
        seen.add(sub)
        found.append((prefix, sub))
        children = sub._modules  # noqa: SLF001
        if children:
            dot = prefix + "." if prefix else ""
            stack.extend([(dot + name, child) for name, child in reversed(children.items())
                          if child is not None])
    return found


_NAMED_MODULES = nn.Module.named_modules


def _add(found: dict[str, torch.Tensor], seen: set[int],
         members: Mapping[str, torch.Tensor | None], prefix: str) -> None:
    """torch's ``Module._named_members`` for one submodule: each tensor once, under its
    first name; None entries skipped."""
    dot = prefix + "." if prefix else ""
    for name, tensor in members.items():
        if tensor is not None and id(tensor) not in seen:
            seen.add(id(tensor))
            found[dot + name] = tensor
