"""Optimizers and schedulers: the forms ``compile`` accepts, and carrying an optimizer from
one set of replicas to another."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn

from fitdp.checks import fail

# Callable, not type[Optimizer]: the base class's __init__ takes no ``lr``, these all do.
OPTIMIZERS: dict[str, tuple[Callable[..., torch.optim.Optimizer], float]] = {
    "sgd": (torch.optim.SGD, 0.01),
    "adam": (torch.optim.Adam, 1e-3),
    "adamw": (torch.optim.AdamW, 1e-3),
    "rmsprop": (torch.optim.RMSprop, 1e-3),
}
# The names torch has a fused CUDA kernel for. A fused optimizer takes GradScaler's found-inf
# flag into its kernel; any other makes GradScaler.step read it on the host (one sync a step).
FUSED = frozenset({"sgd", "adam", "adamw"})

OptimizerArg = (
    str
    | type[torch.optim.Optimizer]
    | torch.optim.Optimizer
    | Callable[[Sequence[nn.Parameter]], torch.optim.Optimizer]
)
Scheduler = Any  # torch.optim.lr_scheduler.LRScheduler or ReduceLROnPlateau-like: has step()
_EXPECTED = ("a name such as 'adam', an optimizer class, a callable(params) -> Optimizer or "
             "an Optimizer instance built on model.module.parameters()")


def build_optimizer(optimizer: OptimizerArg, module: nn.Module, lr: float | None, *,
                    fused: bool = False) -> torch.optim.Optimizer:
    """The optimizer over every parameter of ``module`` (frozen ones too: torch skips a
    parameter without a gradient, and one unfrozen later is then stepped as it should be).
    ``fused``: a name in ``FUSED`` builds torch's fused (CUDA) variant (what ``16-mixed``
    asks for, see above); other names and the user's own optimizers are left as given.

    Raises:
        ValueError: an unknown name, or an Optimizer holding parameters of another module.
        TypeError: an unsupported kind of object, or a callable returning a non-optimizer.
    """
    params = list(module.parameters())
    if isinstance(optimizer, torch.optim.Optimizer):
        ours = {id(p) for p in params}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in ours:
                    fail("optimizer", f"an Optimizer holding a parameter of shape "
                         f"{tuple(p.shape)} that is not in the model's module",
                         "an Optimizer built on model.module.parameters()",
                         "build it on model.module.parameters()", described=True)
        if lr is not None:
            for group in optimizer.param_groups:
                group["lr"] = lr
        return optimizer
    if isinstance(optimizer, str):
        if optimizer.lower() not in OPTIMIZERS:
            fail("optimizer", optimizer, f"one of {sorted(OPTIMIZERS)}, or {_EXPECTED}")
        cls, default_lr = OPTIMIZERS[optimizer.lower()]
        extra = {"fused": True} if fused and optimizer.lower() in FUSED else {}
        return cls(params, lr=default_lr if lr is None else lr, **extra)
    if not callable(optimizer):
        fail("optimizer", optimizer, _EXPECTED, error=TypeError)
    if isinstance(optimizer, type):
        # A user's Optimizer subclass: ``lr`` is its own __init__'s, not the base class's.
        cls = cast(Callable[..., torch.optim.Optimizer], optimizer)
        return cls(params) if lr is None else cls(params, lr=lr)
    built = _built("optimizer", optimizer, params,
                   "lambda params: torch.optim.SGD(params, lr=0.1)")
    if not isinstance(built, torch.optim.Optimizer):
        fail("optimizer", f"a callable that returned {type(built).__name__}",
             "a callable(params) -> torch.optim.Optimizer", error=TypeError, described=True)
    return built


def bind_optimizer(optimizer: torch.optim.Optimizer, targets: Mapping[int, nn.Parameter]) -> None:
    """Carry ``optimizer`` (same object, groups and state) over to other parameter objects:
    the parameters ``id(old) -> new`` in ``targets`` (new replicas, or the host module).

    Works for every optimizer, a user's own class included, because nothing is rebuilt: each
    group's parameter list is changed in place (so an optimizer that keeps a reference to
    it, like LBFGS, follows) and the state goes through ``state_dict``/``load_state_dict``,
    which moves it to the new parameters' device and dtype. A scheduler on ``optimizer``
    stays valid.
    """
    if all(targets.get(id(p), p) is p for g in optimizer.param_groups for p in g["params"]):
        return
    state = optimizer.state_dict()
    for group in optimizer.param_groups:
        group["params"][:] = [targets.get(id(p), p) for p in group["params"]]
    optimizer.state = defaultdict(dict)
    optimizer.load_state_dict(state)


def build_scheduler(spec: Any, optimizer: torch.optim.Optimizer) -> tuple[Scheduler, str]:
    """``compile(lr_scheduler=...)``: a ``callable(optimizer)`` stepped per epoch, or a
    ``(callable, "step")`` pair stepped per optimizer step.

    Raises:
        ValueError, TypeError: a malformed spec, or one the callable refuses (naming
            ``lr_scheduler``); anything else the callable raises propagates.
    """
    if spec is None:
        return None, "epoch"
    interval = "epoch"
    if isinstance(spec, tuple):
        if len(spec) != 2 or spec[1] not in ("epoch", "step"):
            fail("lr_scheduler", spec, "a callable(optimizer) or a (callable, 'step' | "
                 "'epoch') pair")
        spec, interval = spec
    if not callable(spec):
        fail("lr_scheduler", spec, "a callable(optimizer) -> LRScheduler, e.g. "
             "lambda opt: torch.optim.lr_scheduler.StepLR(opt, 10)", error=TypeError)
    scheduler = _built("lr_scheduler", spec, optimizer,
                       "lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=10)")
    if not callable(getattr(scheduler, "step", None)):
        fail("lr_scheduler", f"a callable that returned {type(scheduler).__name__}",
             "a callable(optimizer) returning a scheduler with step()", error=TypeError,
             described=True)
    return scheduler, interval


def _built(name: str, factory: Callable[[Any], Any], arg: Any, example: str) -> Any:
    """``factory(arg)``; a TypeError or ValueError it raises (a class passed without its
    required arguments, e.g. ``StepLR``) comes back naming the argument, torch's error kept
    as the cause."""
    try:
        return factory(arg)
    except (TypeError, ValueError) as err:
        what = getattr(factory, "__qualname__", type(factory).__name__)
        given = "the parameters" if name == "optimizer" else "the optimizer"
        raise type(err)(
            f"{name}: calling {what} with {given} alone raised {type(err).__name__}: {err}; "
            f"expected a callable that builds it from that one argument. Fix: give it its "
            f"other arguments, e.g. {name}={example}."
        ) from err


def optimizer_kind_problem(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]
                           ) -> str | None:
    """Why ``state`` (an optimizer ``state_dict``) cannot load into ``optimizer``, or None."""
    if not isinstance(state, Mapping):
        return "it is not an optimizer state_dict"
    groups = state.get("param_groups")
    if not isinstance(groups, list) or not isinstance(state.get("state"), Mapping):
        return "it is not an optimizer state_dict"
    saved_kind = state.get("fitdp_class")
    kind = type(optimizer).__name__
    if saved_kind is not None and saved_kind != kind:
        return f"it holds {saved_kind} state, but this model's optimizer is {kind}"
    if len(groups) != len(optimizer.param_groups):
        return (f"it has {len(groups)} parameter groups, but this model's {kind} has "
                f"{len(optimizer.param_groups)}")
    if isinstance(optimizer, MultiOptimizer):
        return _parts_problem(optimizer, state.get("optimizers"))
    for i, (saved, ours) in enumerate(zip(groups, optimizer.param_groups)):
        if not isinstance(saved, Mapping) or not isinstance(saved.get("params"), list):
            return f"its group {i} is not a parameter group"
        if len(saved["params"]) != len(ours["params"]):
            return (f"its group {i} has {len(saved['params'])} parameters, but this model's "
                    f"has {len(ours['params'])}")
        missing = sorted(set(ours) - set(saved) - {"params"})
        extra = sorted(set(saved) - set(ours) - {"params"})
        if missing and extra:
            return (f"its hyperparameters {extra} are not those of this model's {kind} "
                    f"({missing}): it comes from another kind of optimizer")
    return None


def _parts_problem(optimizer: MultiOptimizer, parts: Any) -> str | None:
    """Why ``parts`` (a ``MultiOptimizer`` state's optimizers by name) cannot load into
    ``optimizer``'s, or None: other names, or a part of another kind or shape."""
    if not isinstance(parts, Mapping) or set(parts) != set(optimizer.optimizers):
        names = sorted(parts) if isinstance(parts, Mapping) else None
        return (f"it holds the optimizers {names}, but this model was compiled with "
                f"{sorted(optimizer.optimizers)}; compile with the names it was saved with")
    for name, opt in optimizer.optimizers.items():
        problem = optimizer_kind_problem(opt, parts[name])
        if problem:
            return f"optimizer {name!r}: {problem}"
    return None


class MultiOptimizer(torch.optim.Optimizer):
    """Several named optimizers as one (``compile(optimizer={"d": ..., "g": ...})`` or a
    list, names ``"0"``, ``"1"``, ...): what a GAN's two optimizers, or Lightning's manual
    optimization, need. Its ``param_groups`` are the optimizers' own group dicts, so a
    scheduler, ``lr`` logging, carrying to the replicas and checkpoints see every group;
    ``state_dict`` holds each optimizer's under its name. ``step`` steps them all; a custom
    ``train_step`` steps one with ``Model.optimizer_step(name, loss)``.

    Args:
        optimizers: name -> optimizer.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        >>> opt = MultiOptimizer({"a": torch.optim.SGD(net[0].parameters(), lr=0.1),
        ...                       "b": torch.optim.Adam(net[1].parameters())})
        >>> len(opt.param_groups), sorted(opt.state_dict()["optimizers"])
        (2, ['a', 'b'])
    """

    def __init__(self, optimizers: Mapping[str, torch.optim.Optimizer]) -> None:
        self.optimizers = dict(optimizers)
        groups = [g for opt in self.optimizers.values() for g in opt.param_groups]
        super().__init__([{"params": list(g["params"])} for g in groups], {})
        self.param_groups = groups  # the same dicts: an lr set here reaches its optimizer

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        for opt in self.optimizers.values():
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        parts = {name: opt.state_dict() for name, opt in self.optimizers.items()}
        groups = [g for part in parts.values() for g in part["param_groups"]]
        return {"state": {}, "param_groups": groups, "optimizers": parts}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        parts = state_dict.get("optimizers")
        if not isinstance(parts, Mapping) or set(parts) != set(self.optimizers):
            names = sorted(parts) if isinstance(parts, Mapping) else None
            fail("optimizer state", f"optimizers {names}", f"the compiled optimizers "
                 f"{sorted(self.optimizers)}", "load a checkpoint written by a model "
                 "compiled with the same optimizers", described=True)
        for name, opt in self.optimizers.items():
            opt.load_state_dict(parts[name])


def build_optimizers(optimizer: Any, module: nn.Module, lr: float | None, *,
                     fused: bool = False) -> torch.optim.Optimizer:
    """``compile(optimizer=...)``: one optimizer, or a ``MultiOptimizer`` for a dict (name ->
    spec) or a list of specs; each spec as ``build_optimizer`` takes it (an ``Optimizer`` on
    part of the module, e.g. ``torch.optim.Adam(net.discriminator.parameters())``).

    Raises:
        ValueError, TypeError: an empty dict or list, a name that is not a string, or a bad
            spec (see ``build_optimizer``).
    """
    if not isinstance(optimizer, (Mapping, list)):
        return build_optimizer(optimizer, module, lr, fused=fused)
    specs = dict(optimizer) if isinstance(optimizer, Mapping) else {
        str(i): spec for i, spec in enumerate(optimizer)}
    if not specs:
        fail("optimizer", optimizer, "one optimizer, or a non-empty dict or list of them")
    for name in specs:
        if not isinstance(name, str):
            fail("optimizer", f"a dict with the key {name!r}", "string names, e.g. "
                 "{'d': ..., 'g': ...}", error=TypeError, described=True)
    return MultiOptimizer({name: build_optimizer(spec, module, lr, fused=fused)
                           for name, spec in specs.items()})
