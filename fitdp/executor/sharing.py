"""Name checks, replica copies, and parameter sharing between a bucket's module and the
default bucket's."""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable, Sequence
from typing import Any, cast

import torch
from torch import nn


def check_unique_names(module: nn.Module) -> None:
    """Every parameter and buffer name must be unique (the seed's ``_check_arguments``).

    Raises:
        ValueError: naming the duplicated name.
    """
    seen: set[str] = set()
    names = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
    for name in names:
        if name in seen:
            raise ValueError(
                f"module: the name {name!r} is used by two parameters or buffers "
                f"({names}); expected unique names. Fix: rename one of them."
            )
        seen.add(name)


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (module.get_submodule(path) if path else module), leaf


def share_by_name(module: nn.Module, base: nn.Module, bucket_key: Hashable) -> None:
    """Make ``module`` use ``base``'s parameter and buffer objects, matched by name.

    After this, one optimizer step on ``base``'s parameters updates every bucket.

    Raises:
        ValueError: a name ``base`` lacks, or a shape or dtype that differs (naming the
            parameter, both shapes and the bucket key).
    """
    # remove_duplicate=False: a tied weight (e.g. decoder.weight is emb.weight) is replaced
    # under each of its names, so no alias keeps the bucket module's own fresh tensor.
    for kind, theirs, ours in (
        ("parameter", dict(base.named_parameters(remove_duplicate=False)),
         list(module.named_parameters(remove_duplicate=False))),
        ("buffer", dict(base.named_buffers(remove_duplicate=False)),
         list(module.named_buffers(remove_duplicate=False))),
    ):
        for name, tensor in ours:
            shared = theirs.get(name)
            if shared is None:
                raise ValueError(
                    f"bucket_module({bucket_key!r}) returned a module with {kind} {name!r}, "
                    f"which the default bucket's module does not have (it has "
                    f"{sorted(theirs)}). Buckets share every {kind} by name with the default "
                    f"bucket; fix: build the same layers, with the same names, in every bucket."
                )
            if shared.shape != tensor.shape or shared.dtype != tensor.dtype:
                raise ValueError(
                    f"bucket_module({bucket_key!r}): {kind} {name!r} has shape "
                    f"{tuple(tensor.shape)} ({tensor.dtype}) but the default bucket's has "
                    f"{tuple(shared.shape)} ({shared.dtype}); buckets share {kind}s, so they "
                    f"must match. Fix: make the layer sizes independent of the bucket key."
                )
            owner, leaf = _owner(module, name)
            if kind == "parameter":
                owner._parameters[leaf] = cast(nn.Parameter, shared)  # from named_parameters
            else:
                owner._buffers[leaf] = shared


def bucket_replicas(bucket_module: Callable[[Any], nn.Module] | None, key: Hashable,
                    bases: Sequence[nn.Module]) -> list[nn.Module]:
    """One module per device for bucket ``key`` (MXNet's ``sym_gen``), each sharing every
    parameter and buffer by name with that device's default-bucket replica in ``bases``.

    Raises:
        TypeError: an unhashable key, or ``bucket_module`` not returning a module.
        ValueError: a parameter that cannot be shared (see ``share_by_name``).
    """
    try:
        hash(key)
    except TypeError:
        raise TypeError(
            f"bucket_key: got {key!r} of type {type(key).__name__}, which is not hashable; "
            f"expected an int, str or tuple (bucket groups are kept in a dict)"
        ) from None
    first = bucket_module(key) if bucket_module is not None else None
    if not isinstance(first, nn.Module):
        raise TypeError(
            f"bucket_module({key!r}) returned {type(first).__name__}; expected an nn.Module"
        )
    modules = []
    for d, base in enumerate(bases):
        m = first if d == 0 else copy.deepcopy(first)
        share_by_name(m, base, key)
        modules.append(m)
    return modules


def replica(module: nn.Module, device: torch.device, share: bool, *,
            reuse: Sequence[nn.Parameter] = (), hollow: Sequence[nn.Parameter] = ()
            ) -> nn.Module:
    """``module`` itself when ``share`` and it already lives on ``device``, else a copy.

    A copy keeps the parameters in ``reuse`` as they are (the same objects: device 0's
    replica on the host's device holds the host's weights, not a second copy of them) and
    gets an empty placeholder on ``device`` for each one in ``hollow`` (``FlatBuckets`` with
    ``sources`` gives it storage, so those weights are never allocated twice); everything
    else (buffers, other parameters) is copied.
    """
    tensors = [*module.parameters(), *module.buffers()]
    if share and all(t.device == device for t in tensors):
        return module
    memo: dict[int, Any] = {id(p): p for p in reuse}
    for p in hollow:
        memo[id(p)] = nn.Parameter(torch.empty(0, dtype=p.dtype, device=device),
                                   requires_grad=p.requires_grad)
    return copy.deepcopy(module, memo).to(device)


def device_replicas(module: nn.Module, devices: Sequence[torch.device],
                    sources: Sequence[nn.Parameter]) -> list[nn.Module]:
    """One replica of ``module`` per device (the manager's), holding each weight once.

    One device: ``module`` itself. Several, with flat buckets to come (``sources``: the
    host's trainable parameters, ``FlatBuckets``'s ``sources``): device 0's replica on the
    host's device keeps the host's parameter objects (they agree after every step, so the
    host is no second copy of them and averaging into it changes nothing there), and every
    other replica gets hollow ones that the buckets fill straight from the host. Buffers are
    always the replica's own: averaging them into the host never disturbs a replica.
    """
    first = devices[0]
    here = all(t.device == first for t in [*module.parameters(), *module.buffers()])
    return [replica(module, d, share=len(devices) == 1, reuse=sources if i == 0 and here else (),
                    hollow=() if i == 0 and here else sources)
            for i, d in enumerate(devices)]


def hashable(key: Any) -> bool:
    """Whether ``key`` can key a dict (a bucket key)."""
    try:
        hash(key)
    except TypeError:
        return False
    return True
