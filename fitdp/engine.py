"""The training engine behind ``Model``: manager, optimizer, scheduler, metrics and one step."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from torch import nn

from fitdp.batch import DataBatch
from fitdp.devices import DevicesArg, resolve_devices
from fitdp.distributed import all_reduce_sum, average_buffers, broadcast_module
from fitdp.executor.manager import DataParallelExecutorManager
from fitdp.executor.sharded_step import ShardedStep
from fitdp.executor.slicing import check_work_load_list
from fitdp.metrics import DeviceMetrics
from fitdp.objectives import check_targets, resolve_loss
from fitdp.optimizers import build_optimizer, build_scheduler, rebind_optimizer

PRECISIONS = {"32": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


@dataclasses.dataclass
class CompileConfig:
    """Everything ``Model.compile`` was given, validated."""

    optimizer: Any
    loss: Any
    metrics: dict[str, Any]
    lr: float | None = None
    lr_scheduler: Any = None
    precision: str = "32"
    grad_clip_norm: float | None = None
    grad_accum_steps: int = 1
    compile: bool = False
    sync_batchnorm: bool = False


class Engine:
    """One manager and the optimizer state living on it; rebuilt when the devices change.

    The host module (``Model.module``) is the source of truth between calls: ``attach``
    copies it into the replicas, ``detach`` averages the replicas back into it.
    """

    def __init__(
        self,
        module: nn.Module,
        config: CompileConfig,
        bucket_module: Callable[[Any], nn.Module] | None,
    ) -> None:
        self.module = module
        self.config = config
        self.bucket_module = bucket_module
        self.loss_fn = None if config.loss is None else resolve_loss(config.loss)
        self.mgr: DataParallelExecutorManager | None = None
        self.key: tuple[Any, ...] | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        self.scheduler_interval = "epoch"
        self.metrics: DeviceMetrics | None = None
        self.scaler: torch.amp.GradScaler | None = None
        self.micro_step = 0
        self.pending: dict[str, Any] = {}  # loaded before the optimizer existed
        self.sharded: ShardedStep | None = None  # the step split over CPU replicas' threads

    def attach(
        self,
        devices: DevicesArg,
        work_load_list: Sequence[float] | None,
        batch_size: int | None,
        default_bucket_key: Hashable | None = None,
        distributed: bool = False,
    ) -> DataParallelExecutorManager:
        """The manager for these devices (reused when unchanged), with host weights loaded."""
        devs = resolve_devices(devices)
        loads = check_work_load_list(work_load_list, len(devs))
        if batch_size is not None and batch_size < len(devs):
            raise ValueError(
                f"batch_size: got {batch_size} for {len(devs)} devices {[str(d) for d in devs]}; "
                f"expected at least one sample per device. Fix: batch_size >= {len(devs)}, or "
                f"fewer devices."
            )
        dtype = PRECISIONS[self.config.precision]
        if dtype is torch.float16 and any(d.type != "cuda" for d in devs):
            raise ValueError(
                "precision='16-mixed' uses a CUDA GradScaler, but devices include the CPU. "
                "Fix: precision='bf16-mixed' on the CPU, or run on CUDA devices."
            )
        if distributed and self.config.sync_batchnorm:
            self._convert_sync_batchnorm(devs)
        key = (tuple(devs), tuple(loads), default_bucket_key, distributed)
        if self.key is not None and default_bucket_key is None:
            # Data without buckets (validation tensors, predict) runs the default bucket of
            # the manager that exists: no reason to rebuild it.
            key = (key[0], key[1], self.key[2], key[3])
        if self.mgr is None or key != self.key:
            previous = None
            if self.mgr is not None:
                self.detach()
                previous = self.mgr.master_parameters()
                self.mgr.close()
            self.mgr = DataParallelExecutorManager(
                self.module, devs, work_load_list=loads, bucket_module=self.bucket_module,
                default_bucket_key=default_bucket_key, loss=self.loss_fn,
                compile=self.config.compile, autocast_dtype=dtype, distributed=distributed,
            )
            self.key = key
            self._build_optimizer(previous)
            self.metrics = DeviceMetrics(self.config.metrics, devs) if self.config.metrics else None
            self.scaler = torch.amp.GradScaler("cuda") if dtype is torch.float16 else None
            self.load_training_state(self.pending)
            cpus = [d for d in devs if d.type == "cpu"]
            self.sharded = (
                ShardedStep(self.optimizer, self.mgr.workers, len(devs))
                if len(cpus) == len(devs) > 1 and self.optimizer is not None
                and ShardedStep.supports(self.optimizer) else None
            )
        if distributed:
            broadcast_module(self.module)  # every rank starts from rank 0's weights
        self.mgr.set_params(*self.host_state())
        return self.mgr

    def _convert_sync_batchnorm(self, devices: Sequence[torch.device]) -> None:
        """Caffe2's ``combine_spatial_bn``: BatchNorm statistics over every rank's batch."""
        if any(d.type != "cuda" for d in devices):
            raise ValueError(
                "compile(sync_batchnorm=True): torch's SyncBatchNorm runs on CUDA only, but "
                f"devices are {[str(d) for d in devices]}. Fix: drop sync_batchnorm on the CPU "
                "(fitdp then averages BatchNorm running statistics over ranks at epoch ends)."
            )
        if not any(isinstance(m, nn.SyncBatchNorm) for m in self.module.modules()):
            converted = nn.SyncBatchNorm.convert_sync_batchnorm(self.module)
            if converted is not self.module:
                raise ValueError(
                    "compile(sync_batchnorm=True): the module itself is a BatchNorm layer; wrap "
                    "it in an nn.Sequential so it can be converted in place"
                )

    def load_training_state(self, state: dict[str, Any]) -> None:
        """Optimizer, scheduler and scaler state from a checkpoint; kept until they exist
        when the model is compiled but has not run yet."""
        self.pending = {}
        for name in ("optimizer", "scheduler", "scaler"):
            if state.get(name) is None:
                continue
            obj = getattr(self, name)
            if obj is not None:
                obj.load_state_dict(state[name])
            elif self.config.optimizer is not None:
                self.pending[name] = state[name]

    @property
    def manager(self) -> DataParallelExecutorManager:
        if self.mgr is None:
            raise RuntimeError("the engine has no manager yet; call attach() first")
        return self.mgr

    def _build_optimizer(self, previous: list[nn.Parameter] | None) -> None:
        params = self.manager.master_parameters()
        if self.config.optimizer is None:
            return
        if self.optimizer is None or previous is None:
            named = dict(zip(self.manager.param_names, params))
            self.optimizer = build_optimizer(
                self.config.optimizer, named, self.module, self.config.lr
            )
            self.scheduler, self.scheduler_interval = build_scheduler(
                self.config.lr_scheduler, self.optimizer
            )
            return
        # New replicas: carry the optimizer (and scheduler) state over to their parameters.
        sched_state = self.scheduler.state_dict() if self.scheduler is not None else None
        self.optimizer = rebind_optimizer(
            self.optimizer, {id(old): new for old, new in zip(previous, params)}
        )
        if sched_state is not None:
            self.scheduler, _ = build_scheduler(self.config.lr_scheduler, self.optimizer)
            self.scheduler.load_state_dict(sched_state)

    def host_state(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The host module's parameters and buffers by name (the tensors themselves)."""
        return dict(self.module.named_parameters()), dict(self.module.named_buffers())

    def detach(self) -> None:
        """Average the replicas into the host module (in place)."""
        if self.mgr is not None:
            arg, aux = self.host_state()
            self.mgr.copy_to(arg, aux)

    def check_batch(self, batch: DataBatch) -> None:
        """Checks made on the first batch of a call, before any weight changes."""
        if batch.label is not None:
            check_targets(self.config.loss, batch.label)

    def train_step(self, batch: DataBatch) -> bool:
        """Forward, backward and (every ``grad_accum_steps`` batches) one optimizer step.

        Returns whether the optimizer stepped.
        """
        mgr = self.manager
        if self.micro_step == 0:
            # Zeroed here, not after the step, so gradients stay readable until the next
            # step begins (monitors, callbacks).
            mgr.zero_grad()
        mgr.load_data_batch(batch)
        mgr.forward(is_train=True, total_rows=batch.global_rows)
        self.micro_step += 1
        step_now = self.micro_step >= self.config.grad_accum_steps
        mgr.backward(reduce=False, scale=self._loss_scale())
        if self.metrics:
            mgr.update_metric(self.metrics)
        if step_now:
            self._optimizer_step()
        return step_now

    def flush(self) -> bool:
        """Step on gradients still accumulating at the end of an epoch; True if it stepped."""
        if self.micro_step == 0:
            return False
        self._optimizer_step()
        return True

    def _optimizer_step(self) -> None:
        """Reduce gradients, clip, step, and copy device 0's parameters to the other devices."""
        mgr, opt, cfg = self.manager, self.optimizer, self.config
        if opt is None:
            raise RuntimeError("compile() the model with an optimizer before training")
        self.micro_step = 0
        mgr.reduce_gradients()
        if self.scaler is not None:
            self.scaler.unscale_(opt)
        if cfg.grad_clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(mgr.master_parameters(), cfg.grad_clip_norm)
        if self.scaler is not None:
            self.scaler.step(opt)
            self.scaler.update()
        elif self.sharded is not None:
            self.sharded.step()
        else:
            opt.step()
        if self.scheduler is not None and self.scheduler_interval == "step":
            self.scheduler.step()
        mgr.sync_params()

    def _loss_scale(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        accum = self.config.grad_accum_steps
        scaler = self.scaler
        if scaler is not None:
            return lambda loss: scaler.scale(loss / accum)
        if accum > 1:
            return lambda loss: loss / accum
        return None

    def eval_step(self, batch: DataBatch, with_metrics: bool) -> None:
        mgr = self.manager
        mgr.load_data_batch(batch)
        mgr.forward(is_train=False)
        if with_metrics and self.metrics:
            mgr.update_metric(self.metrics)

    def read_logs(self) -> dict[str, float]:
        """Mean loss and every metric so far (the one host sync of a log point)."""
        total, count = self.manager.loss_state()
        if self.manager.distributed:
            both = torch.stack([total.double().reshape(()), torch.tensor(float(count)).to(total)])
            total, count = all_reduce_sum(both)
        logs = {"loss": float(total) / float(count)} if count else {}
        if self.metrics:
            logs.update(self.metrics.compute())
        return logs

    def step_epoch_scheduler(self) -> None:
        """Step a per-epoch LR scheduler (at the end of every epoch)."""
        if self.scheduler is not None and self.scheduler_interval == "epoch":
            with warnings.catch_warnings():
                # After resuming at an epoch's end no optimizer step precedes this one in
                # this process; the order is right, torch's warning is not.
                warnings.filterwarnings("ignore", "Detected call of `lr_scheduler")
                self.scheduler.step()

    def sync_buffers(self) -> None:
        """Average BatchNorm running statistics over ranks (and this rank's replicas)."""
        mgr = self.manager
        if mgr.distributed and mgr.aux_arrays:
            average_buffers(mgr.aux_arrays, torch.distributed.get_world_size())

    def reset_logs(self) -> None:
        self.manager.reset_loss()
        if self.metrics:
            self.metrics.reset()
