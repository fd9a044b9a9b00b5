"""One bucket's executors across devices (MXNet's ``DataParallelExecutorGroup``)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import nn

from fitdp.data.batch import axis_of
from fitdp.executor.compile_config import CompileConfig
from fitdp.executor.replica import Executor
from fitdp.executor.step import DeviceWorkers, Job, device_share

# Layers that draw from the generator in training: their CPU replicas run forward in turn.
_RANDOM_LAYERS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                  nn.FeatureAlphaDropout, nn.RReLU)


class DataParallelExecutorGroup:
    """The executors of one bucket, one per device, run concurrently by ``workers``.

    Args:
        modules: one replica per device (already on it).
        devices: the devices, in order.
        shared_buffers: per device, the input buffers shared with the other buckets.
        workers: the manager's device threads.
        bucket_key: the bucket this group runs (None without bucketing).
        compile: ``torch.compile`` each replica (one graph per input shape).
        compile_config: the caller's compile settings for the replica threads, or None.
        logger: where the bucketing re-allocation warning goes (default: ``fitdp``).
        inputs_need_grad: track gradients of the inputs (``get_input_grads``).

    Example:
        >>> g = DataParallelExecutorGroup([nn.Linear(3, 1)], [torch.device("cpu")], [{}],
        ...                               DeviceWorkers(1))
        >>> g.param_names
        ['weight', 'bias']
    """

    def __init__(
        self,
        modules: Sequence[nn.Module],
        devices: Sequence[torch.device],
        shared_buffers: Sequence[dict[str, tuple[torch.Tensor, tuple[int, ...]]]],
        workers: DeviceWorkers,
        *,
        bucket_key: Hashable | None = None,
        compile: bool | str = False,
        logger: logging.Logger | None = None,
        inputs_need_grad: bool = False,
        compile_config: CompileConfig | None = None,
    ) -> None:
        self.bucket_key = bucket_key
        self.bucketed = bucket_key is not None  # its executors share input buffers
        self.workers = workers
        self.logger = logger or logging.getLogger("fitdp")
        self.executors = [
            Executor(m, d, b, compile=compile, warn_on_grow=bucket_key is not None,
                     inputs_need_grad=inputs_need_grad, compile_config=compile_config)
            for m, d, b in zip(modules, devices, shared_buffers)
        ]
        named = [dict(m.named_parameters()) for m in modules]
        # Every parameter, frozen ones too: they are replicated, averaged and saved like
        # buffers; only the trainable ones get gradients and optimizer steps.
        self.param_names = list(named[0])
        self.param_arrays: list[list[nn.Parameter]] = [
            [params[n] for params in named] for n in self.param_names
        ]
        self.stochastic: bool | None = None  # does a training forward draw random numbers?
        buffers = [dict(m.named_buffers()) for m in modules]
        self.aux_names = list(buffers[0])
        self.aux_arrays = [[b[n] for b in buffers] for n in self.aux_names]
        # This batch's work, read by the device threads; the shares are made once (and hold
        # the job, never the group: a dropped model frees its threads at once).
        job = self.job = Job(self.executors)
        self.shares = [functools.partial(device_share, job, d) for d in range(len(devices))]

    @property
    def slices(self) -> list[slice]:
        """Each device's rows of the current batch."""
        return self.job.slices

    @property
    def grad_arrays(self) -> list[list[torch.Tensor | None]]:
        return [[p.grad for p in row] for row in self.param_arrays]

    def set_mode(self, is_train: bool) -> None:
        """Training or inference layers on every replica. Read rather than cached: with one
        device the replica is the user's module, which the user may switch between calls
        (``train()`` walks every submodule: only when the mode changes)."""
        for ex in self.executors:
            if ex.module.training is not is_train:
                ex.module.train(is_train)

    def begin_turns(self, is_train: bool) -> list[torch.Tensor] | None:
        """Whether forwards take turns this batch (``job.in_turn``, or ``job.step_turns``
        for a compute that takes them itself: a custom step, whose replicas meet mid-step);
        the generators' states when this is the probe (see ``_draws_in_turn``)."""
        job, step = self.job, self.job.step
        turns = is_train and self.stochastic is not False and self._draws_in_turn()
        job.step_turns = turns and getattr(step and step.compute, "takes_turns", False)
        job.in_turn = turns and not job.step_turns
        if not turns:
            return None
        for event in job.turn:
            event.clear()
        return self._rng_states() if self.stochastic is None else None

    def end_turns(self, before: list[torch.Tensor] | None) -> None:
        if before is not None:  # the probe: did that forward draw random numbers?
            after = self._rng_states()
            self.stochastic = any(not torch.equal(a, b) for a, b in zip(before, after))

    def _rng_states(self) -> list[torch.Tensor]:
        """The states of the generators the replicas draw from (one per distinct device)."""
        return [torch.get_rng_state() if d.type == "cpu" else torch.cuda.get_rng_state(d)
                for d in dict.fromkeys(ex.device for ex in self.executors)]

    def _draws_in_turn(self) -> bool:
        """Whether training forwards must run one after another, in device order.

        Replicas on one device share its generator (every CPU replica shares torch's CPU
        generator): run at once, their dropout masks depend on which thread draws first, and a
        seeded run is not reproducible. So a module that draws random numbers runs such
        replicas' forwards in device order (backward stays concurrent); one that never draws
        keeps them concurrent. Decided once per group: by its layers, or else by whether its
        first training forward (run in turn) moved the generators (``stochastic`` stays None
        until then).
        """
        if self.stochastic is None:
            devices = [ex.device for ex in self.executors]
            if len(set(devices)) == len(devices):  # one generator each: no race
                self.stochastic = False
            elif any(isinstance(m, _RANDOM_LAYERS) and getattr(m, "p", 1) > 0
                     for m in self.executors[0].module.modules()):
                self.stochastic = True
        return self.stochastic is not False

    def warn_grown(self) -> None:
        """The seed's re-allocation warning, once per input name for all devices."""
        grown: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        for ex in self.executors:
            for name, shape, allocated in ex.grown:
                grown.setdefault(name, (shape, allocated))
            ex.grown.clear()
        for name, (shape, allocated) in grown.items():
            self.logger.warning(
                'bucketing: data "%s" has a shape %s, which is larger than already allocated '
                "shape %s. Need to re-allocate. Consider putting default_bucket_key to be "
                "the bucket taking the largest input for better memory sharing.",
                name, shape, allocated,
            )

    def input_grads(self, merge: bool) -> list[Any]:
        """Each input's gradient (see ``manager.get_input_grads``): devices joined along the
        batch axis on device 0 (``merge``), else a list of each device's slice."""
        per_device = [ex.input_grads() for ex in self.executors if ex.valid > 0]
        columns = [list(col) for col in zip(*per_device)]
        if not merge:
            return columns
        axis, dev = self.executors[0].axis, self.executors[0].device
        return [None if any(g is None for g in col) else
                torch.cat([g.to(dev) for g in col], dim=axis_of(col[0], axis))
                for col in columns]

    def outputs(self) -> list[Any]:
        """Each device's outputs, padding rows removed."""
        return [ex.valid_outputs(ex.outputs) for ex in self.executors]
