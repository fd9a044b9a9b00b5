"""Metrics per device slice: a torchmetrics clone per device, merged only when computed."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_cat

MetricsArg = Sequence[Metric] | Mapping[str, Metric] | None


def snake_case(name: str) -> str:
    """``MulticlassAccuracy`` -> ``multiclass_accuracy`` (the metric's log key)."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


def named_metrics(metrics: MetricsArg) -> dict[str, Metric]:
    """Validate ``compile(metrics=...)`` and give each metric its log key.

    Raises:
        TypeError: an entry that is not a ``torchmetrics.Metric``.
        ValueError: two metrics with the same log key.
    """
    if metrics is None:
        return {}
    if isinstance(metrics, Metric):
        metrics = [metrics]
    items = (
        list(metrics.items())
        if isinstance(metrics, Mapping)
        else [(snake_case(type(m).__name__), m) for m in metrics]
    )
    out: dict[str, Metric] = {}
    for name, metric in items:
        if not isinstance(metric, Metric):
            raise TypeError(
                f"metrics: {name!r} is {type(metric).__name__}, not a torchmetrics.Metric. "
                f"Expected a list or dict of torchmetrics metrics, e.g. "
                f"[MulticlassAccuracy(num_classes=10)]. Fix: wrap a function in "
                f"torchmetrics (or a MeanMetric) instead of passing it directly."
            )
        if name in out or name == "loss":
            raise ValueError(
                f"metrics: two metrics share the log key {name!r}; pass a dict to name them, "
                f"e.g. {{'acc_top1': ..., 'acc_top5': ...}}"
            )
        out[name] = metric
    return out


class DeviceMetrics:
    """One clone of every metric per device, updated on that device with its slice.

    ``compute`` merges the clones with each state's own reduction (the same rule torchmetrics
    uses to sync processes), so the result equals the metric run on the whole epoch at once.

    Args:
        metrics: log key -> metric (the user's objects are never updated).
        devices: one clone set per device.

    Example:
        >>> from torchmetrics.classification import MulticlassAccuracy
        >>> cpu = torch.device("cpu")
        >>> dm = DeviceMetrics({"acc": MulticlassAccuracy(num_classes=2)}, [cpu, cpu])
        >>> dm.update(0, torch.tensor([[1.0, 0.0]]), torch.tensor([0]))
        >>> dm.update(1, torch.tensor([[1.0, 0.0]]), torch.tensor([1]))
        >>> dm.compute()
        {'acc': 0.5}
    """

    def __init__(self, metrics: Mapping[str, Metric], devices: Sequence[torch.device]) -> None:
        self.templates = dict(metrics)
        self.devices = list(devices)
        self.clones = [
            {n: copy.deepcopy(m).to(dev) for n, m in self.templates.items()} for dev in devices
        ]
        for clones in self.clones:
            for m in clones.values():
                m.reset()

    def __bool__(self) -> bool:
        return bool(self.templates)

    def update(self, device_index: int, outputs: Any, labels: Any) -> None:
        """Update device ``device_index``'s clones (called on that device's thread)."""
        for m in self.clones[device_index].values():
            m.update(outputs, labels)

    def reset(self) -> None:
        for clones in self.clones:
            for m in clones.values():
                m.reset()

    def compute(self) -> dict[str, float]:
        """Merge the device clones and compute every metric (a host sync)."""
        logs = {}
        for name in self.templates:
            merged = self._merge([clones[name] for clones in self.clones])
            value = merged.compute()
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
                raise ValueError(
                    f"metrics: {name!r} computed {shape}, but logs hold one number per metric. "
                    f"Fix: configure it to reduce to a scalar (e.g. average='macro')."
                )
            logs[name] = float(value)
        return logs

    @staticmethod
    def _merge(clones: Sequence[Metric]) -> Metric:
        if len(clones) == 1:
            return clones[0]
        merged = copy.deepcopy(clones[0])
        for attr, reduce_fn in merged._reductions.items():
            states = [getattr(c, attr) for c in clones]
            if isinstance(states[0], torch.Tensor):
                states = [s.to(merged.device) for s in states]
                if reduce_fn is dim_zero_cat:
                    value: Any = torch.cat([s.reshape(-1, *s.shape[1:]) for s in states])
                elif reduce_fn is None:
                    value = torch.stack(states)
                else:
                    # add_state turns the reduction names ("sum", "mean", ...) into functions.
                    fn = cast(Callable[[torch.Tensor], torch.Tensor], reduce_fn)
                    value = fn(torch.stack(states))
            else:
                value = [t.to(merged.device) for s in states for t in s]
            setattr(merged, attr, value)
        merged._update_count = sum(c._update_count for c in clones)
        merged._computed = None
        return merged
