"""One bucket's executors across devices (MXNet's ``DataParallelExecutorGroup``)."""

from __future__ import annotations

import functools
import logging
import operator
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from torch import nn

from fitdp.batch import DataBatch, tree_map
from fitdp.executor.executor import Executor, LossFn
from fitdp.executor.workers import DeviceWorkers

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
        logger: where the bucketing re-allocation warning goes (default: ``fitdp``).

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
        compile: bool = False,
        logger: logging.Logger | None = None,
    ) -> None:
        self.bucket_key = bucket_key
        self.workers = workers
        self.logger = logger or logging.getLogger("fitdp")
        self.executors = [
            Executor(m, d, b, compile=compile, warn_on_grow=bucket_key is not None)
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
        self.slices: list[slice] = []

    @property
    def grad_arrays(self) -> list[list[torch.Tensor | None]]:
        return [[p.grad for p in row] for row in self.param_arrays]

    def _run(self, fn: Callable[[Executor], Any]) -> list[Any]:
        return self.workers.run([functools.partial(fn, ex) for ex in self.executors])

    def load_data_batch(self, batch: DataBatch, slices: list[slice]) -> None:
        """Copy each device's slice of ``batch`` into its input buffers."""
        self.slices = slices
        valid_end = batch.batch_size - batch.pad
        if len(slices) == 1:
            self.executors[0].load(batch.data, batch.label, valid_end, batch.sample_weight)
            self._warn_grown()
            return
        for ex, sl in zip(self.executors, slices):
            valid = max(0, min(sl.stop, valid_end) - sl.start)
            take = operator.itemgetter(sl)
            label = None if batch.label is None else tree_map(take, batch.label)
            weight = None if batch.sample_weight is None else batch.sample_weight[sl]
            ex.load(tree_map(take, batch.data), label, valid, weight)
        self._warn_grown()

    def _warn_grown(self) -> None:
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

    def forward(
        self,
        is_train: bool,
        loss_fn: LossFn | None,
        total_rows: int | torch.Tensor,
        autocast_dtype: torch.dtype | None,
    ) -> None:
        """Run every replica on its slice; each loss is weighted by ``valid / total_rows``."""
        # Read the mode rather than cache it: with one device the replica is the user's module,
        # which the user may switch between calls (train() walks every submodule: only then).
        for ex in self.executors:
            if ex.module.training is not is_train:
                ex.module.train(is_train)
        denom = total_rows.clamp(min=1) if isinstance(total_rows, torch.Tensor) else float(
            max(total_rows, 1))

        def task(ex: Executor) -> None:
            ex.forward(is_train, loss_fn, ex.valid / denom, autocast_dtype)

        if is_train and self._draws_in_turn():
            before = torch.get_rng_state() if self.stochastic is None else None
            for ex in self.executors:
                task(ex)
            if before is not None:  # the probe: did that forward draw random numbers?
                self.stochastic = not torch.equal(before, torch.get_rng_state())
        else:
            self._run(task)

    def _draws_in_turn(self) -> bool:
        """Whether training forwards must run one after another, in device order.

        CPU replicas share torch's one CPU generator: run at once, their dropout masks depend
        on which thread draws first, and a seeded run is not reproducible. So a module that
        draws random numbers runs its CPU replicas' forwards in device order (backward stays
        concurrent); one that never draws keeps them concurrent. Decided once per group: by
        its layers, or else by whether its first training forward (run in turn) moved the
        generator (``stochastic`` stays None until then).
        """
        if self.stochastic is None:
            if sum(ex.device.type == "cpu" for ex in self.executors) < 2:
                self.stochastic = False
            elif any(isinstance(m, _RANDOM_LAYERS) for m in self.executors[0].module.modules()):
                self.stochastic = True
        return self.stochastic is not False

    def backward(self, scale: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Backward on every replica, at once."""
        self._run(lambda ex: ex.backward(scale))
        for ex in self.executors:
            if ex.stream is not None:
                ex.stream.synchronize()

    def update_metric(self, metric: Any, labels: Any = None) -> None:
        """Update each device's clone of ``metric`` with that device's outputs and labels."""

        def update(ex: Executor, d: int) -> None:
            lab = ex.labels if labels is None else tree_map(lambda t: t[self.slices[d]], labels)
            with ex.stream_context():
                if ex.valid > 0:
                    metric.update(d, ex.valid_rows(ex.outputs), ex.valid_rows(lab))

        self.workers.run([functools.partial(update, ex, d) for d, ex in enumerate(self.executors)])

    def outputs(self) -> list[Any]:
        """Each device's outputs, padding rows removed."""
        return [ex.valid_rows(ex.outputs) for ex in self.executors]
