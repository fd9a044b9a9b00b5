"""What ``Model.compile`` builds: the objective, the optimizer and its schedule, the metrics
and the precision. Built whole or not at all, so a failing piece changes nothing."""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fitdp.checks import check_choice, check_int, check_number, fail
from fitdp.compiled.losses import Objective
from fitdp.compiled.metrics import MetricsArg, MetricSpec, metric_specs
from fitdp.compiled.optimizers import (
    MultiOptimizer,
    OptimizerArg,
    Scheduler,
    build_optimizers,
    build_scheduler,
)
from fitdp.compiled.own_loss import OwnLoss, own_loss
from fitdp.compiled.token_view import TokenView
from fitdp.executor.checkpointing import check_blocks
from fitdp.executor.engines import Strategy, check_strategy

PRECISIONS: dict[str, torch.dtype | None] = {
    "32": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16,
}


# compile=True, or one of torch.compile's modes ("reduce-overhead": CUDA graphs per shape).
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclasses.dataclass(frozen=True)
class CompileArgs:
    """Everything ``Model.compile`` was given."""

    optimizer: OptimizerArg | Mapping[str, OptimizerArg] | list[OptimizerArg] = "adam"
    loss: Any = "cross_entropy"
    metrics: MetricsArg = None
    lr: float | None = None
    lr_scheduler: Any = None
    precision: str = "32"
    grad_clip_norm: float | None = None
    grad_accum_steps: int = 1
    compile: bool | str = False
    sync_batchnorm: bool = False
    loss_weights: Sequence[float] | Mapping[str, float] | None = None
    strategy: Strategy = "auto"
    weighted_metrics: MetricsArg = None
    loss_items: Any = None
    forward_kwargs: Mapping[str, Any] | None = None
    activation_checkpointing: Sequence[type[nn.Module]] | None = None


class Compiled:
    """The compiled training setup of a model.

    Attributes:
        config: what compile was given.
        objective: ``(outputs, targets[, sample_weight]) -> loss``; an ``OwnLoss`` for
            ``loss=None`` (the module's own loss).
        optimizer: built on the host module's parameters (carried to the replicas by the
            model when they exist); a ``MultiOptimizer`` for several; None for a module
            without parameters, which can be evaluated but not trained.
        manual: several optimizers: the model's ``train_step`` steps them
            (``Model.optimizer_step``), fitdp does not.
        scheduler: the LR scheduler or None; ``interval`` is ``"epoch"`` or ``"step"``.
        metrics: log key -> metric spec (templates: never updated themselves).
        autocast_dtype: the autocast dtype of mixed precision, or None.
        scaler: the GradScaler of ``16-mixed``, made when the model first runs on CUDA.

    Example:
        >>> t = Compiled.build(nn.Linear(3, 2), CompileArgs(optimizer="sgd", lr=0.5))
        >>> t.optimizer.param_groups[0]["lr"], t.interval
        (0.5, 'epoch')
    """

    def __init__(self, config: CompileArgs, objective: Objective | OwnLoss,
                 optimizer: torch.optim.Optimizer | None, scheduler: Scheduler, interval: str,
                 metrics: dict[str, MetricSpec]) -> None:
        self.config = config
        self.objective = objective
        self.optimizer = optimizer
        self.manual = isinstance(optimizer, MultiOptimizer)
        self.scheduler = scheduler
        self.interval = interval
        self.metrics = metrics
        self.autocast_dtype = PRECISIONS[config.precision]
        self.scaler: torch.amp.GradScaler | None = None

    @classmethod
    def build(cls, module: nn.Module, config: CompileArgs) -> Compiled:
        """Check every argument and build every piece; raise before anything is kept.

        Raises:
            ValueError, TypeError: a bad argument, naming it; whatever the optimizer or
                scheduler factory raises.
        """
        check_choice("precision", config.precision, tuple(PRECISIONS))
        if config.grad_clip_norm is not None:
            check_number("grad_clip_norm", config.grad_clip_norm, low=0, low_open=True)
        check_int("grad_accum_steps", config.grad_accum_steps, 1, maximum=sys.maxsize)
        lr = None if config.lr is None else check_number(
            "lr", config.lr, low=0, fix="pass a learning rate >= 0 (0 freezes the weights)")
        if not isinstance(config.compile, bool):
            check_choice("compile", config.compile, COMPILE_MODES)
        if not isinstance(config.sync_batchnorm, bool):
            check_choice("sync_batchnorm", config.sync_batchnorm, (True, False))
        check_strategy(config.strategy)
        check_forward_kwargs(config.forward_kwargs)
        check_blocks(config.activation_checkpointing, module)
        objective = own_loss(config.loss, config.loss_items, module) or Objective(
            config.loss, config.loss_weights)
        # The model's own outputs are read in transformers' layout (class last, per token).
        view = TokenView(objective.shifts) if isinstance(objective, OwnLoss) else None
        metrics = metric_specs(config.metrics, config.weighted_metrics,
                               objective.binary_outputs(), view)
        if not any(True for _ in module.parameters()):  # nn.Identity: nothing to optimize
            return cls(config, objective, None, None, "epoch", metrics)
        # 16-mixed runs on CUDA only: a fused optimizer there spares GradScaler a sync a step.
        optimizer = build_optimizers(config.optimizer, module, lr,
                                     fused=config.precision == "16-mixed")
        if isinstance(optimizer, MultiOptimizer) and config.grad_accum_steps > 1:
            # A train_step that steps its optimizers itself decides when they step; fitdp
            # cannot postpone them (Lightning's manual optimization leaves it to the user too).
            fail("grad_accum_steps", config.grad_accum_steps, "1 with several optimizers "
                 "(train_step steps them itself with Model.optimizer_step)",
                 "compile with grad_accum_steps=1 and accumulate in train_step: call "
                 "optimizer_step every N batches, or use one optimizer")
        scheduler, interval = build_scheduler(config.lr_scheduler, optimizer)
        return cls(config, objective, optimizer, scheduler, interval, metrics)

    @property
    def forward_kwargs(self) -> dict[str, Any]:
        """Keyword arguments every forward of the module gets (``compile(forward_kwargs=)``)."""
        return dict(self.config.forward_kwargs or {})

    def trainable(self, module: nn.Module) -> torch.optim.Optimizer:
        """The optimizer ``fit`` steps.

        Raises:
            ValueError: ``module`` has no parameters (nothing to train; evaluate and predict
                run it as it is).
        """
        if self.optimizer is None:
            fail("module", f"{type(module).__name__}, which has no parameters",
                 "a module with parameters to train", "evaluate or predict it as it is (they "
                 "need no optimizer), or give the module trainable layers", described=True)
        return self.optimizer

    @property
    def learning_rates(self) -> dict[str, float]:
        """The rates an epoch's logs record: ``lr``, the first parameter group's; with
        several optimizers each one's first group's, as ``<name>_lr`` (``d_lr``, ``g_lr``:
        the first alone would be logged unnamed as every optimizer's)."""
        optimizer = self.optimizer
        if isinstance(optimizer, MultiOptimizer):
            named = {f"{name}_lr": _first_rate(opt) for name, opt in optimizer.optimizers.items()}
            return {k: v for k, v in named.items() if v is not None}
        lr = _first_rate(optimizer) if optimizer is not None else None
        return {} if lr is None else {"lr": lr}

    def loss_scale(self) -> Any:
        """What ``backward`` multiplies each loss by: ``1 / grad_accum_steps`` (the update is
        the mean over the accumulated batches), times the 16-mixed loss scale."""
        accum = self.config.grad_accum_steps
        scaler = self.scaler
        if scaler is not None:
            return lambda loss: scaler.scale(loss / accum)
        if accum > 1:
            return lambda loss: loss / accum
        return None

    def step_scheduler(self, interval: str) -> None:
        """Step the scheduler if it runs per ``interval`` ("epoch" or "step")."""
        if self.scheduler is None or self.interval != interval:
            return
        if not _may_warn_of_order(self.scheduler):
            self.scheduler.step()
            return
        with warnings.catch_warnings():
            # A run resumed at an epoch's end steps the scheduler before any optimizer step
            # of this process: the order is right, torch's warning is not.
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler")
            self.scheduler.step()


def _may_warn_of_order(scheduler: Any) -> bool:
    """Whether ``scheduler.step()`` may warn that it runs before ``optimizer.step()``: torch's
    own test (``LRScheduler.step``: the scheduler's first step, its optimizer not stepped
    yet), read with defaults that say yes for a scheduler of another kind.

    Only then is the warning filtered: ``catch_warnings`` swaps the process-wide filter list
    and resets every module's record of warnings shown, so entered on every step it showed a
    user's show-once warning again at each step, and dropped filters another thread set."""
    optimizer = getattr(scheduler, "optimizer", None)
    return getattr(scheduler, "_step_count", 1) == 1 and not getattr(
        optimizer, "_opt_called", False)


def check_forward_kwargs(kwargs: Any) -> None:
    """``compile(forward_kwargs=...)``: a dict of keyword arguments fixed for every forward
    (e.g. ``{"use_cache": False}``).

    Raises:
        TypeError: not a dict with string keys.
    """
    if kwargs is None:
        return
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        fail("forward_kwargs", kwargs, "a dict of keyword arguments for the module's forward, "
             "such as {'use_cache': False}", error=TypeError)


def _first_rate(optimizer: torch.optim.Optimizer) -> float | None:
    """The learning rate of ``optimizer``'s first parameter group, or None."""
    groups = optimizer.param_groups
    lr = groups[0].get("lr") if groups else None
    return float(lr) if isinstance(lr, (int, float, torch.Tensor)) else None
