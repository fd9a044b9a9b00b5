"""Optimizers and schedulers: the forms ``compile`` accepts, built on the device-0 replica."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn

# Callable, not type[Optimizer]: the base class's __init__ takes no ``lr``, these all do.
OPTIMIZERS: dict[str, tuple[Callable[..., torch.optim.Optimizer], float]] = {
    "sgd": (torch.optim.SGD, 0.01),
    "adam": (torch.optim.Adam, 1e-3),
    "adamw": (torch.optim.AdamW, 1e-3),
    "rmsprop": (torch.optim.RMSprop, 1e-3),
}

OptimizerArg = (
    str
    | type[torch.optim.Optimizer]
    | torch.optim.Optimizer
    | Callable[[Sequence[nn.Parameter]], torch.optim.Optimizer]
)


def check_optimizer(optimizer: OptimizerArg) -> None:
    """Validate ``compile(optimizer=...)`` before anything is built.

    Raises:
        ValueError: an unknown name. TypeError: an unsupported kind of object.
    """
    if isinstance(optimizer, str):
        if optimizer.lower() not in OPTIMIZERS:
            raise ValueError(
                f"optimizer: unknown name {optimizer!r}; expected one of {sorted(OPTIMIZERS)}, "
                f"an optimizer class, a callable(params) -> Optimizer or an Optimizer instance"
            )
    elif not (isinstance(optimizer, torch.optim.Optimizer) or callable(optimizer)):
        raise TypeError(
            f"optimizer: got {type(optimizer).__name__}; expected a name such as 'adam', an "
            f"optimizer class, a callable(params) -> Optimizer or an Optimizer instance"
        )


def build_optimizer(
    optimizer: OptimizerArg,
    named_params: Mapping[str, nn.Parameter],
    host: nn.Module,
    lr: float | None,
) -> torch.optim.Optimizer:
    """Build the optimizer over ``named_params`` (the device-0 replica's parameters).

    An Optimizer instance built on ``host.parameters()`` is re-created over the replica's
    parameters with the same class, groups and state (the same object when they coincide).
    """
    params = list(named_params.values())
    if isinstance(optimizer, torch.optim.Optimizer):
        names = {id(p): n for n, p in host.named_parameters()}
        mapping: dict[int, nn.Parameter] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in names:
                    raise ValueError(
                        f"optimizer: the Optimizer holds a parameter of shape {tuple(p.shape)} "
                        f"that is not in the model's module. Fix: build it on "
                        f"model.module.parameters()."
                    )
                mapping[id(p)] = named_params[names[id(p)]]
        return rebind_optimizer(optimizer, mapping)
    if isinstance(optimizer, str):
        cls, default_lr = OPTIMIZERS[optimizer.lower()]
        return cls(params, lr=default_lr if lr is None else lr)
    if isinstance(optimizer, type):
        # A user's Optimizer subclass: ``lr`` is its own __init__'s, not the base class's.
        cls = cast(Callable[..., torch.optim.Optimizer], optimizer)
        return cls(params) if lr is None else cls(params, lr=lr)
    built = optimizer(params)
    if not isinstance(built, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer: the callable returned {type(built).__name__}; expected a "
            f"torch.optim.Optimizer built on the parameters it was given"
        )
    return built


def rebind_optimizer(
    optimizer: torch.optim.Optimizer, mapping: Mapping[int, nn.Parameter]
) -> torch.optim.Optimizer:
    """The same optimizer (class, groups, state) over other parameter objects.

    ``mapping`` maps ``id(old parameter)`` to its new parameter. Returns ``optimizer`` itself
    when nothing changes.
    """
    if all(mapping.get(id(p), p) is p for g in optimizer.param_groups for p in g["params"]):
        return optimizer
    groups = [
        {**{k: v for k, v in g.items() if k != "params"},
         "params": [mapping[id(p)] for p in g["params"]]}
        for g in optimizer.param_groups
    ]
    new = type(optimizer)(groups, **optimizer.defaults)
    new.load_state_dict(optimizer.state_dict())
    return new


def build_scheduler(
    spec: Any, optimizer: torch.optim.Optimizer
) -> tuple[torch.optim.lr_scheduler.LRScheduler | None, str]:
    """``compile(lr_scheduler=...)``: a ``callable(optimizer)`` stepped per epoch, or a
    ``(callable, "step")`` pair stepped per optimizer step."""
    if spec is None:
        return None, "epoch"
    interval = "epoch"
    if isinstance(spec, tuple):
        if len(spec) != 2 or spec[1] not in ("epoch", "step"):
            raise ValueError(
                f"lr_scheduler: got {spec!r}; expected a callable(optimizer) or a "
                f"(callable, 'step' | 'epoch') pair"
            )
        spec, interval = spec
    if not callable(spec):
        raise TypeError(
            f"lr_scheduler: got {type(spec).__name__}; expected a callable(optimizer) -> "
            f"LRScheduler, e.g. lambda opt: torch.optim.lr_scheduler.StepLR(opt, 10)"
        )
    return spec(optimizer), interval
