"""Metrics per device slice: a torchmetrics clone per device, merged only when computed."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torchmetrics import Metric

from fitdp.compiled.metric_specs import MetricsArg, MetricSpec, metric_specs, snake_case
from fitdp.data.batch import tree_leaves, tree_map
from fitdp.data.sequence import batch_first

__all__ = ["MERGE_FIX", "DeviceMetrics", "MetricsArg", "MetricSpec", "metric_specs",
           "snake_case"]

# Metric.merge_state, the public merge this relies on, is in torchmetrics >= 1.6.0.
MERGE_FIX = (
    "Fix: train on one device (e.g. devices=['cpu']), or subclass the metric and override "
    "merge_state(self, incoming_state) to combine two states (torchmetrics' own advice)"
)


class DeviceMetrics:
    """One clone of every metric per device, updated on that device with its slice.

    ``compute`` merges the clones with torchmetrics' public ``Metric.merge_state`` (each state
    by its own reduction: counts added, lists concatenated, ...), so the result equals the
    metric run on the whole epoch at once. Metrics never keep a tensor fitdp reuses or one
    that carries autograd history (see ``update``).

    Args:
        metrics: log key -> metric (the user's objects are never updated).
        devices: one clone set per device.

    Raises:
        ValueError: with several devices, a metric that ``merge_state`` refuses (e.g.
            ``full_state_update=True``, ``dist_sync_on_step=True``), before any step.

    Example:
        >>> from torchmetrics.classification import MulticlassAccuracy
        >>> cpu = torch.device("cpu")
        >>> dm = DeviceMetrics({"acc": MulticlassAccuracy(num_classes=2)}, [cpu, cpu])
        >>> dm.update(0, torch.tensor([[1.0, 0.0]]), torch.tensor([0]))
        >>> dm.update(1, torch.tensor([[1.0, 0.0]]), torch.tensor([1]))
        >>> dm.compute()
        {'acc': 0.5}
    """

    def __init__(self, metrics: Mapping[str, Metric | MetricSpec],
                 devices: Sequence[torch.device]) -> None:
        self.templates = {n: m if isinstance(m, MetricSpec) else MetricSpec(m)
                          for n, m in metrics.items()}
        self.devices = list(devices)
        # The batch axis of the data being run (set per batch by the session): time-major
        # outputs and labels are moved batch-first before update (``sequence.batch_first``).
        self.axis = 0
        self.specs = [{n: m.on(dev) for n, m in self.templates.items()} for dev in devices]
        self.reset()
        if len(self.devices) > 1:
            for name, spec in self.templates.items():
                if spec.metric is None:
                    continue  # a Keras name: built on the first batch, of mergeable kinds
                clones = [c[name] for c in self.clones]
                for m in clones:
                    # compute() runs on a clone with the others merged in, then puts its own
                    # states back: a cached value would outlive that and go stale.
                    m.compute_with_cache = False
                self._check_mergeable(name, clones)

    @property
    def clones(self) -> list[dict[str, Metric]]:
        """Per device, log key -> its metric (those built so far: a Keras name is built on
        the device's first batch)."""
        return [{n: s.metric for n, s in specs.items() if s.metric is not None}
                for specs in self.specs]

    def __bool__(self) -> bool:
        return bool(self.templates)

    def update(self, device_index: int, outputs: Any, labels: Any,
               weight: torch.Tensor | None = None) -> None:
        """Update device ``device_index``'s clones (called on that device's thread).

        Args:
            device_index: which device's clones.
            outputs: that device's valid output rows (detached here: no metric keeps a graph).
            labels: that device's valid label rows, often a view of a buffer fitdp reuses.
            weight: that device's valid rows of the sample weights, or None (read by the
                ``weighted_metrics`` only).
        """
        outputs, labels = tree_map(torch.Tensor.detach, (outputs, labels))
        if self.axis:
            outputs, labels = batch_first(outputs, labels, self.axis)
        inputs = {_storage(t) for t in tree_leaves((outputs, labels, weight))}
        for spec in self.specs[device_index].values():
            m = spec.metric
            lengths = {} if m is None else {
                k: len(v) for k, v in m.metric_state.items() if isinstance(v, list)}
            m = spec.update(outputs, labels, weight if spec.weighted else None)
            # Only a state sharing storage with an input can see the next batch overwrite it
            # (a 'cat' list holding the label view, a tensor state set to an input); states
            # computed from the inputs (counts, sums, sigmoids) own new storage. So copy
            # exactly those: accuracy-like metrics never pay for a copy.
            for key, value in m.metric_state.items():
                if isinstance(value, torch.Tensor):
                    if _storage(value) in inputs:
                        setattr(m, key, value.clone())
                    continue
                start = lengths.get(key, 0) if len(value) >= lengths.get(key, 0) else 0
                for i in range(start, len(value)):
                    if isinstance(value[i], torch.Tensor) and _storage(value[i]) in inputs:
                        value[i] = value[i].clone()

    def reset(self) -> None:
        """Reset every clone (the start of an epoch, of an evaluation)."""
        for clones in self.clones:
            for m in clones.values():
                m.reset()

    def compute(self) -> dict[str, float]:
        """Merge the device clones and compute every metric (a host sync).

        Returns:
            log key -> value.

        Raises:
            ValueError: a metric that does not compute to one number.
        """
        logs = {}
        for name in self.templates:
            built = [c[name] for c in self.clones if name in c]
            if not built:  # a Keras name that saw no batch (Keras: a fresh metric's 0)
                logs[name] = 0.0
                continue
            value = self._compute_one(built)
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
                raise ValueError(
                    f"metrics: {name!r} computed {shape}, but logs hold one number per metric. "
                    f"Fix: configure it to reduce to a scalar (e.g. average='macro')."
                )
            logs[name] = float(value)
        return logs

    @staticmethod
    def _compute_one(clones: Sequence[Metric]) -> Any:
        # A device that saw no rows adds nothing (its default state would otherwise count as
        # one more participant in a max or mean). With none updated, computing any clone
        # gives torchmetrics' own "compute before update" behaviour.
        updated = [m for m in clones if m.update_count > 0] or [clones[0]]
        if len(updated) == 1:
            return updated[0].compute()
        # merge_state needs an updated metric to merge into (its 'mean' rule divides by the
        # target's update count), so the first updated clone is the target, lent for the call.
        with _merged(updated[0], updated[1:]):
            return updated[0].compute()

    def _check_mergeable(self, name: str, clones: Sequence[Metric]) -> None:
        """Merge the fresh clones once, so a refusal comes now and not at the first log."""
        metric = clones[0]
        try:
            with _merged(metric, clones[1:]):
                pass
        except (RuntimeError, TypeError, ValueError) as err:
            cls = type(metric).__name__
            why = f"it refused: {err}"
            fix = MERGE_FIX
            if metric.dist_sync_on_step:
                why = "it was built with dist_sync_on_step=True"
                fix += ", or build it without dist_sync_on_step (fitdp syncs at log points)"
            elif metric.full_state_update is None:
                why = "its class does not declare full_state_update (read as True)"
                fix += (f", or if {cls}.update only adds each batch to its states, declare "
                        f"the class attribute full_state_update = False")
            elif metric.full_state_update:
                why = "its class declares full_state_update=True (update reads the whole state)"
            raise ValueError(
                f"metrics: {name!r} ({cls}) cannot be merged across devices "
                f"{[str(d) for d in self.devices]}: "
                f"fitdp keeps one clone per device and merges them with torchmetrics' "
                f"Metric.merge_state, and {why}. {fix}."
            ) from err


@contextmanager
def _merged(target: Metric, others: Sequence[Metric]) -> Iterator[None]:
    """``target`` holds its own states merged with ``others``' inside the block, and exactly
    its own states again after it (the others are only read)."""
    own = target.metric_state
    # A merge_state override may work in place (`self.total += ...`): let it work on copies,
    # never on the states the target keeps accumulating. Lists copy references only.
    for key, value in own.items():
        setattr(target, key, value.clone() if isinstance(value, torch.Tensor) else list(value))
    try:
        for other in others:
            target.merge_state(_state_on(other, target.device))
        yield
    finally:
        for key, value in own.items():
            setattr(target, key, value)


def _state_on(metric: Metric, device: torch.device) -> dict[str, Any]:
    """``metric``'s states on ``device`` (no copy where they already are)."""
    return {
        k: v.to(device) if isinstance(v, torch.Tensor)
        else [t.to(device) if isinstance(t, torch.Tensor) else t for t in v]
        for k, v in metric.metric_state.items()
    }


def _storage(t: torch.Tensor) -> int:
    """Where ``t``'s memory starts: equal for a tensor and every view of it."""
    return t.untyped_storage().data_ptr()
