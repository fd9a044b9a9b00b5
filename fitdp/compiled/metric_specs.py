"""``compile(metrics=..., weighted_metrics=...)`` as log key -> ``MetricSpec``: which output
each metric reads, whether it takes the sample weights, and Keras's metric names, built into
torchmetrics metrics on the first batch (``keras_names``). Log keys follow Keras 3
(``compile_utils.CompileMetrics.result``)."""

from __future__ import annotations

import copy
import re
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch
from torchmetrics import Metric

from fitdp.compiled.keras_names import METRIC_NAMES, WEIGHTABLE, Prepare, build_metric
from fitdp.compiled.token_view import TokenView

MetricArg = Metric | str
MetricsArg = (Sequence[MetricArg] | Sequence[Sequence[MetricArg] | None]
              | Mapping[str, MetricArg] | Mapping[str, Sequence[MetricArg]] | None)


def snake_case(name: str) -> str:
    """``MulticlassAccuracy`` -> ``multiclass_accuracy`` (the metric's log key)."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


class MetricSpec:
    """One compiled metric: a torchmetrics metric (or a Keras name, built on the first update
    from that batch's outputs and targets), the output it reads and whether it is weighted.

    Args:
        metric: a ``torchmetrics.Metric`` or a name of ``keras_names.METRIC_NAMES``.
        output: the key or index of the output (and target) it reads; None: all of them.
        weighted: updated with the batch's sample weights (``weighted_metrics``).
        binary_loss: the output's loss is a binary one (float targets of several columns
            are then multilabel, not one-hot).
        view: how it reads a module's own outputs (``compile(loss=None)``: class-last logits
            per token), or None: the outputs and targets as they are (class axis 1).

    Example:
        >>> spec = MetricSpec("accuracy")
        >>> metric = spec.build(torch.tensor([[2.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 0]))
        >>> type(metric).__name__
        'MulticlassAccuracy'
    """

    def __init__(self, metric: MetricArg, output: Hashable | None = None, *,
                 weighted: bool = False, binary_loss: bool = False,
                 view: TokenView | None = None) -> None:
        self.name = metric if isinstance(metric, str) else None
        self.metric: Metric | None = None if isinstance(metric, str) else metric
        self.output, self.weighted, self.binary_loss = output, weighted, binary_loss
        self.view = view
        self.prepare: Prepare | None = None
        # A Keras name's metric is built from the first outputs and targets it sees, by
        # their shapes and dtypes only (``task_of``): kept without rows, so that a resume
        # builds the same metric before any batch (``restore``).
        self.built_from: tuple[torch.Tensor, torch.Tensor] | None = None
        self.device: torch.device | None = None  # a clone's (``on``)
        # The updates the states a resume put back hold: torchmetrics' own count (updates
        # in this process) has no public setter.
        self.restored = 0

    @property
    def updates(self) -> int:
        """Updates since the last reset, those before a resume included."""
        return self.restored + (self.metric.update_count if self.metric is not None else 0)

    def reset(self) -> None:
        """Forget every update (torchmetrics' ``reset``) and what a resume put back."""
        if self.metric is not None:
            self.metric.reset()
        self.restored = 0

    def restore(self, state: Mapping[str, Any], updates: int,
                built_from: Sequence[torch.Tensor] | None = None) -> None:
        """Put back ``state`` (a ``metric_state`` saved after ``updates`` updates) through
        torchmetrics' public API: as the metric's states when it holds none yet (after
        ``reset``: no cached value survives), else merged in with ``merge_state``. A Keras
        name not built yet is built first, from the saved ``built_from``.

        Raises:
            ValueError: ``state`` holds other states than the metric's, or a Keras name
                comes without what it was built from.
        """
        if self.metric is None:
            if built_from is None:
                raise ValueError(f"metrics: {self.name!r} was saved without what it was "
                                 f"built from. Fix: resume from a checkpoint of an epoch's end.")
            outputs, labels = (t.to(self.device) for t in built_from)
            self.build(outputs, labels)
        metric = self.metric
        assert metric is not None  # noqa: S101 - built above
        problem = state_problem(metric, state)
        if problem:
            raise ValueError(f"metrics: {problem}. Fix: resume with the metrics the "
                             f"checkpoint was saved with.")
        values = state_on_device(state, metric.device)
        if self.updates == 0:
            metric.reset()
            for key, value in values.items():
                setattr(metric, key, value)  # its declared states (``add_state``)
        else:
            metric.merge_state(values)
        self.restored += updates

    def on(self, device: torch.device) -> MetricSpec:
        """A fresh copy for ``device`` (the template is never updated)."""
        spec = copy.deepcopy(self)
        spec.device = device
        if spec.metric is not None:
            spec.metric = spec.metric.to(device)
        return spec

    def build(self, outputs: torch.Tensor, labels: torch.Tensor) -> Metric:
        """The metric, a Keras name's built first from these outputs and targets (on their
        device)."""
        if self.metric is None:
            metric, self.prepare = build_metric(
                str(self.name), outputs, labels, binary_loss=self.binary_loss,
                weighted=self.weighted)
            # compute() may run on a clone with other devices' states merged in: no cache.
            metric.compute_with_cache = False
            self.metric = metric.to(outputs.device)
            self.built_from = (outputs[:0].detach(), labels[:0].detach())
        return self.metric


def state_problem(metric: Metric, state: Any) -> str | None:
    """Why ``state`` is not a saved ``metric_state`` of ``metric``, or None."""
    if not isinstance(state, Mapping):
        return f"{type(metric).__name__}: got {type(state).__name__}, not a metric state"
    if set(state) != set(metric.metric_state):
        return (f"the saved states {sorted(state)} are not those of this model's "
                f"{type(metric).__name__} ({sorted(metric.metric_state)})")
    return None


def state_on_device(state: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """``state`` (a ``metric_state``) on ``device``: no copy where it already is."""
    return {
        k: v.to(device) if isinstance(v, torch.Tensor)
        else [t.to(device) if isinstance(t, torch.Tensor) else t for t in v]
        for k, v in state.items()
    }


def metric_specs(metrics: Any, weighted_metrics: Any = None,
                 binary_losses: Mapping[Hashable | None, bool] | None = None,
                 view: TokenView | None = None) -> dict[str, MetricSpec]:
    """Check ``compile``'s ``metrics`` and ``weighted_metrics`` and give each its log key.

    Args:
        metrics: None; a metric or a list of them (log key: a Keras name as written, a
            metric's class name in snake_case); a dict of log key -> metric; per output,
            a list of lists (by position) or a dict of output key -> list of metrics (log
            key: ``"{output}_{name}"``, Keras's).
        weighted_metrics: the same forms, updated with the sample weights (a name already
            taken by ``metrics`` gets ``weighted_`` before it, as in Keras).
        binary_losses: output key (None: the only output) -> whether its loss is binary.
        view: how every metric reads the module's own outputs (``MetricSpec``), or None.

    Returns:
        log key -> spec, in the order given (weighted ones last).

    Raises:
        TypeError: an argument of another form, an entry that is neither a
            ``torchmetrics.Metric`` nor a known name, or a weighted torchmetrics metric.
        ValueError: an unknown or unweightable name; two metrics with the same log key.
    """
    binary = dict(binary_losses or {})
    out: dict[str, MetricSpec] = {}
    for arg, weighted in (("metrics", False), ("weighted_metrics", True)):
        value = metrics if not weighted else weighted_metrics
        for key, output, metric in _entries(value, arg):
            _check_entry(arg, key, metric, weighted)
            spec = MetricSpec(metric, output, weighted=weighted,
                              binary_loss=binary.get(output, False), view=view)
            prefix = "" if output is None else (
                f"output_{output}_" if isinstance(output, int) else f"{output}_")
            if key is None:  # named by the metric (and, per output, the output)
                key = prefix + (metric if isinstance(metric, str) else snake_case(
                    type(metric).__name__))
                if weighted and key in out:
                    key = prefix + "weighted_" + key.removeprefix(prefix)
            if key in out or key == "loss":
                raise ValueError(
                    f"{arg}: two metrics share the log key {key!r}; pass a dict to name them, "
                    f"e.g. {{'acc_top1': ..., 'acc_top5': ...}}")
            out[key] = spec
    return out


def _entries(metrics: Any, arg: str) -> list[tuple[str | None, Hashable | None, Any]]:
    """(log key or None, output or None, metric) for every metric of ``metrics``."""
    if metrics is None:
        return []
    if isinstance(metrics, (Metric, str)):
        if isinstance(metrics, str):
            raise TypeError(
                f"{arg}: got str {metrics!r}; expected a torchmetrics.Metric, a list of them "
                f"or of Keras names: {arg}=[{metrics!r}], as in Keras (its 'accuracy' on "
                f"class-index targets is MulticlassAccuracy(num_classes=..., "
                f"average='micro')).")
        return [(None, None, metrics)]
    if isinstance(metrics, Mapping):
        lists = [isinstance(v, (list, tuple)) for v in metrics.values()]
        if lists and all(lists):  # per output: {"cls": [...], "box": [...]}
            return [(None, k, m) for k, ms in metrics.items() for m in ms]
        if any(lists):
            _bad_form(arg, metrics, "a dict of only metrics (log keys) or only lists (per "
                      "output)")
        return [(str(k), None, m) for k, m in metrics.items()]
    if isinstance(metrics, (list, tuple)):
        nested = [isinstance(v, (list, tuple)) or v is None for v in metrics]
        if nested and all(nested):  # per output, by position: [[...], [...]]
            return [(None, i, m) for i, ms in enumerate(metrics) for m in ms or ()]
        if any(nested):
            _bad_form(arg, metrics, "a list of only metrics, or only lists (one per output)")
        return [(None, None, m) for m in metrics]
    hint = (" Keras' 'accuracy' works in a list: metrics=['accuracy']."
            if arg == "metrics" else "")
    raise TypeError(
        f"{arg}: got {type(metrics).__name__} {metrics!r}; expected a torchmetrics.Metric, "
        f"a list of them or of Keras names, e.g. ['accuracy'] or "
        f"[MulticlassAccuracy(num_classes=10)], or a dict naming them, "
        f"e.g. {{'acc': MulticlassAccuracy(num_classes=10)}}.{hint}")


def _bad_form(arg: str, metrics: Any, expected: str) -> None:
    raise TypeError(f"{arg}: got {metrics!r}, which mixes lists and metrics; expected "
                    f"{expected}.")


def _check_entry(arg: str, key: str | None, metric: Any, weighted: bool) -> None:
    label = repr(key) if key is not None else repr(metric)
    if isinstance(metric, str):
        if metric not in METRIC_NAMES:
            raise ValueError(f"{arg}: unknown metric name {metric!r}; expected one of "
                             f"{sorted(METRIC_NAMES)} or a torchmetrics.Metric.")
        if weighted and metric not in WEIGHTABLE:
            raise ValueError(
                f"weighted_metrics: {metric!r} is not a mean over samples, so it cannot take "
                f"sample weights; expected one of {sorted(WEIGHTABLE)}. Fix: move it to "
                f"metrics=.")
        return
    if arg == "metrics" and isinstance(metric, (int, float)) and not isinstance(metric, bool):
        raise TypeError(
            f"metrics: got the number {metric!r}; expected torchmetrics metrics or Keras "
            f"names. compile's third positional argument is metrics in fitdp, but "
            f"loss_weights in Keras. Fix: pass loss_weights=... (and metrics=...) by "
            f"keyword.")
    if not isinstance(metric, Metric):
        raise TypeError(
            f"{arg}: {label} is {type(metric).__name__}, not a torchmetrics.Metric. "
            f"Expected a list or dict of torchmetrics metrics or Keras names, e.g. "
            f"[MulticlassAccuracy(num_classes=10)] or ['accuracy']. Fix: wrap a function in "
            f"torchmetrics (or a MeanMetric) instead of passing it directly.")
    if weighted:
        raise TypeError(
            f"weighted_metrics: {label} ({type(metric).__name__}) is a torchmetrics metric, "
            f"and torchmetrics' update takes no sample weights. Expected a Keras name that "
            f"is a mean over samples, one of {sorted(WEIGHTABLE)}. Fix: use such a name "
            f"there, or move the metric to metrics=.")
