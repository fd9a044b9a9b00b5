"""Metrics per device slice: a torchmetrics clone per device, merged only when computed."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torchmetrics import Metric
from torchmetrics.classification import (
    MulticlassConfusionMatrix,
    MulticlassExactMatch,
    MulticlassStatScores,
)

from fitdp.checks import first_line, reworded
from fitdp.compiled.metric_specs import (
    MetricsArg,
    MetricSpec,
    metric_specs,
    snake_case,
    state_on_device,
    state_problem,
)
from fitdp.data.batch import tree_cat, tree_leaves, tree_map
from fitdp.data.sequence import batch_first

__all__ = ["DeviceMetrics", "MetricsArg", "MetricSpec", "metric_specs", "snake_case"]

# Classification metrics that never look at the range of their inputs: the multiclass ones
# that take the argmax of scores (or the labels). Every other classification metric passes
# scores through torchmetrics' normalize_logits_if_needed, which applies a sigmoid or softmax
# to an update only when some value lies outside [0, 1]: decided per update, so per device
# slice, and a batch of logits whose slice happens to lie in [0, 1] would be read as
# probabilities on one device and as logits on the other.
_SLICE_SAFE = (MulticlassStatScores, MulticlassConfusionMatrix, MulticlassExactMatch)
_PER_UPDATE_FORMAT = ("torchmetrics.classification", "torchmetrics.wrappers")
# torchmetrics' warning for a compute() on a metric it counts no update of.
_BEFORE_UPDATE = r"The ``compute`` method of metric .* before the ``update`` method"


class DeviceMetrics:
    """One clone of every metric per device, updated on that device with its slice.

    ``compute`` merges the clones with torchmetrics' public ``Metric.merge_state`` (each state
    by its own reduction: counts added, lists concatenated, ...), so the result equals the
    metric run on the whole epoch at once. Two kinds of metric cannot be updated per slice
    and update once per batch instead (``end_batch``), on the first device's clone, with the
    batch's slices joined in device order: exactly the update one device makes.

    - Metrics that ``merge_state`` refuses (``full_state_update=True`` such as
      ``PearsonCorrCoef``, ``dist_sync_on_step=True``, a class that does not declare it).
    - Classification metrics that read scores as logits or probabilities per update (every
      binary and multilabel one, multiclass curves, AUROC, calibration, hinge): torchmetrics
      applies a sigmoid or softmax only when some value of an update lies outside [0, 1].

    What that costs: per batch, the slices' outputs and labels copied onto the first device
    (``torch.cat``; no copy with one slice), and the update on the calling thread after the
    devices' hand-off instead of on the devices' threads. Multiclass accuracy-like metrics
    (argmax of the scores), regression and aggregation metrics stay per slice, free.
    Metrics never keep a tensor fitdp reuses or one that carries autograd history.

    Args:
        metrics: log key -> metric (the user's objects are never updated).
        devices: one clone set per device.

    Example:
        >>> from torchmetrics.classification import BinaryAccuracy
        >>> cpu = torch.device("cpu")
        >>> dm = DeviceMetrics({"acc": BinaryAccuracy()}, [cpu, cpu])
        >>> dm.update(0, torch.tensor([0.3, 3.0]), torch.tensor([1, 1]))
        >>> dm.update(1, torch.tensor([0.3, -3.0]), torch.tensor([1, 1]))
        >>> dm.end_batch()  # logits (one device would read the batch so): sigmoid(0.3) > 0.5
        >>> dm.compute()
        {'acc': 0.75}
    """

    def __init__(self, metrics: Mapping[str, Metric | MetricSpec],
                 devices: Sequence[torch.device]) -> None:
        self.templates = {n: m if isinstance(m, MetricSpec) else MetricSpec(m)
                          for n, m in metrics.items()}
        self.devices = list(devices)
        # The batch axis of the data being run (set per batch by the bound step): time-major
        # outputs and labels are moved batch-first before update (``sequence.batch_first``).
        self.axis = 0
        self.specs = [{n: m.on(dev) for n, m in self.templates.items()} for dev in devices]
        self.whole: list[str] = []  # updated once per batch, on the first device's clone
        if len(self.devices) > 1:
            for name, spec in self.templates.items():
                if spec.metric is None:
                    continue  # a Keras name: built on the first batch, of mergeable kinds
                clones = [c[name] for c in self.clones]
                for m in clones:
                    # compute() runs on a clone with the others merged in, then puts its own
                    # states back: a cached value would outlive that and go stale.
                    m.compute_with_cache = False
                if _reads_range(spec.metric) or not _mergeable(clones):
                    self.whole.append(name)
        self._sliced = [[(n, s) for n, s in specs.items() if n not in self.whole]
                        for specs in self.specs]
        self._pending: list[tuple[Any, Any, Any] | None] = [None] * len(self.devices)
        self.reset()

    @property
    def clones(self) -> list[dict[str, Metric]]:
        """Per device, log key -> its metric (those built so far: a Keras name is built on
        the device's first batch)."""
        return [{n: s.metric for n, s in specs.items() if s.metric is not None}
                for specs in self.specs]

    def __bool__(self) -> bool:
        return bool(self.templates)

    def update(self, device_index: int, outputs: Any, labels: Any,
               weight: torch.Tensor | None = None, out_axes: Any = None) -> None:
        """Update device ``device_index``'s clones (called on that device's thread); the
        metrics updated once per batch keep the slice for ``end_batch``.

        Args:
            device_index: which device's clones.
            outputs: that device's valid output rows (detached here: no metric keeps a graph).
            labels: that device's valid label rows, often a view of a buffer fitdp reuses.
            weight: that device's valid rows of the sample weights, or None (read by the
                ``weighted_metrics`` only).
            out_axes: each output's batch axis (``Executor.output_axes``: time-major data's
                outputs may be batch-first already); None: the batch's.
        """
        detach = torch.Tensor.detach
        outputs, labels = tree_map(detach, outputs), tree_map(detach, labels)
        if self.axis:
            outputs, labels = batch_first(outputs, labels, self.axis, out_axes)
        if self.whole:
            self._pending[device_index] = (outputs, labels, weight)
        sliced = self._sliced[device_index]
        if sliced:
            # Each tree on its own: plain tensors (the common case) need no walk.
            inputs = set()
            for t in tree_leaves(outputs) + tree_leaves(labels) + tree_leaves(weight):
                inputs.add(t.untyped_storage().data_ptr())
            for name, spec in sliced:
                _update_owned(name, spec, outputs, labels, weight, inputs)

    def end_batch(self, axis: int = 0) -> None:
        """After every device's ``update`` of a batch: update the metrics that need the
        whole batch, with the slices joined in device order along the batch ``axis`` (0
        when ``update`` made them batch-first)."""
        if not self.whole:
            return
        parts = [p for p in self._pending if p is not None]
        if not parts:
            return
        self._pending = [None] * len(self.devices)
        dev, axis = self.devices[0], 0 if self.axis else axis
        moved = [tree_map(lambda t: t.to(dev), p) for p in parts]
        joined = moved[0] if len(moved) == 1 else tuple(
            None if moved[0][i] is None else tree_cat([p[i] for p in moved], axis)
            for i in range(3))
        outputs, labels, weight = joined
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves(joined)}
        for name in self.whole:
            _update_owned(name, self.specs[0][name], outputs, labels, weight, inputs)

    def reset(self) -> None:
        """Reset every clone (the start of an epoch, of an evaluation)."""
        self._pending = [None] * len(self.devices)
        for specs in self.specs:
            for spec in specs.values():
                spec.reset()

    def compute(self) -> dict[str, float]:
        """Merge the device clones and compute every metric (a host sync).

        Returns:
            log key -> value.

        Raises:
            ValueError: a metric that does not compute to one number.
        """
        self.end_batch()  # slices updated outside an executor (no hand-off ended them)
        logs = {}
        for name in self.templates:
            built = [specs[name] for specs in self.specs if specs[name].metric is not None]
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

    def state_dict(self) -> list[dict[str, dict[str, Any]]]:
        """Every clone's states and update count, per device (copies: updates go on), and
        for a Keras name what its metric was built from (no rows), so a resume builds it."""
        out: list[dict[str, dict[str, Any]]] = []
        for specs in self.specs:
            saved: dict[str, dict[str, Any]] = {}
            for name, spec in specs.items():
                if spec.metric is None:
                    continue
                saved[name] = {"state": _copied(spec.metric.metric_state),
                               "updates": spec.updates}
                if spec.built_from is not None:
                    saved[name]["built_from"] = list(spec.built_from)
            out.append(saved)
        return out

    def state_problem(self, state: Any) -> str | None:
        """Why ``state`` (a ``state_dict``) cannot load into these metrics, or None."""
        if not isinstance(state, list) or not all(isinstance(s, Mapping) for s in state):
            return "the metric states are not a list of dicts, one per device"
        for d, saved in enumerate(state):
            for name, entry in saved.items():
                if name not in self.templates:
                    continue
                if not isinstance(entry, Mapping) or not isinstance(entry.get("updates"), int):
                    return f"metric {name!r}: not a saved metric state"
                metric = self.specs[min(d, len(self.specs) - 1)][name].metric
                if metric is None and not _tensors(entry.get("built_from"), 2):
                    return f"metric {name!r}: saved without what its Keras metric is built from"
                problem = state_problem(metric, entry.get("state")) if metric else None
                if problem:
                    return f"metric {name!r}: {problem}"
        return None

    def load_state_dict(self, state: Sequence[Mapping[str, Mapping[str, Any]]]) -> None:
        """Put saved states back (a resume), through torchmetrics' public API
        (``MetricSpec.restore``); states of devices beyond these are merged into the last
        device's clones (a resume on fewer devices)."""
        for d, saved in enumerate(state):
            for name, entry in saved.items():
                if name in self.templates and entry["updates"]:
                    spec = self.specs[min(d, len(self.specs) - 1)][name]
                    spec.restore(entry["state"], int(entry["updates"]), entry.get("built_from"))

    @staticmethod
    def _compute_one(specs: Sequence[MetricSpec]) -> Any:
        # A device that saw no rows adds nothing (its default state would otherwise count as
        # one more participant in a max or mean). With none updated, computing any clone
        # gives torchmetrics' own "compute before update" behaviour.
        updated = [s for s in specs if s.updates > 0] or [specs[0]]
        target = updated[0].metric
        assert target is not None  # noqa: S101 - only built specs are computed
        # catch_warnings swaps process-wide state (see compiled/setup.py): entered only
        # when a filter is needed.
        quiet = warnings.catch_warnings() if updated[0].restored else nullcontext()
        with quiet:
            if updated[0].restored:
                # States a resume put back count as updates; torchmetrics counts only this
                # process's and would call them "not yet updated".
                warnings.filterwarnings("ignore", message=_BEFORE_UPDATE)
            if len(updated) == 1:
                return target.compute()
            # merge_state needs an updated metric to merge into (its 'mean' rule divides by
            # the target's update count), so the first updated clone is the target, lent for
            # the call.
            with _merged(target, [s.metric for s in updated[1:]]):  # type: ignore[misc]
                return target.compute()


def _reads_range(metric: Metric) -> bool:
    """Whether ``metric`` may read one update's scores as logits and another's as
    probabilities (see ``_SLICE_SAFE``); wrappers are taken to, whatever they wrap."""
    if isinstance(metric, _SLICE_SAFE):
        return False
    return any(c.__module__.startswith(_PER_UPDATE_FORMAT) for c in type(metric).__mro__)


def _mergeable(clones: Sequence[Metric]) -> bool:
    """Whether ``merge_state`` merges these (fresh) clones: it refuses
    ``full_state_update=True`` and ``dist_sync_on_step=True`` unless the class overrides it."""
    try:
        with _merged(clones[0], clones[1:]):
            pass
    except (RuntimeError, TypeError, ValueError):
        return False
    return True


def _update_owned(name: str, spec: MetricSpec, outputs: Any, labels: Any,
                  weight: torch.Tensor | None, inputs: set[int]) -> None:
    """``spec``'s metric updated with its output of ``outputs`` and ``labels`` (a Keras name's
    metric built first), then every state that shares storage with an input copied
    (``inputs``: their storages). Only such a state can see the next batch overwrite it (a
    'cat' list holding the label view, a tensor state set to an input); states computed from
    the inputs (counts, sums, sigmoids) own new storage: accuracy-like metrics never pay.
    A failing update is raised naming the metric (log key ``name``)."""
    m = spec.metric
    lengths: dict[str, int] = {}  # each list state's length before the update
    if m is not None:
        for key, value in m.metric_state.items():
            if isinstance(value, list):
                lengths[key] = len(value)
    try:
        preds, target = outputs, labels
        if spec.output is not None:
            preds, target = outputs[spec.output], labels[spec.output]
        view = spec.view
        if view is not None:  # a module's own (class-last) logits: one row per token
            preds, target = view(preds, target)
        if m is None:
            m = spec.build(preds, target)
        if view is not None:
            preds, target = view.kept(m, preds, target)
        if spec.prepare is not None:
            m.update(*spec.prepare(preds, target, weight if spec.weighted else None))
        else:
            m.update(preds, target)
    except Exception as err:
        kind = type(spec.metric).__name__ if spec.metric is not None else str(spec.name)
        raise metric_failure(name, kind, outputs, labels, err) from err
    for key, value in m.metric_state.items():
        if isinstance(value, torch.Tensor):
            if value.untyped_storage().data_ptr() in inputs:
                setattr(m, key, value.clone())
            continue
        start = lengths.get(key, 0) if len(value) >= lengths.get(key, 0) else 0
        for i in range(start, len(value)):
            if isinstance(value[i], torch.Tensor) and \
                    value[i].untyped_storage().data_ptr() in inputs:
                value[i] = value[i].clone()


def metric_failure(name: str, kind: str, outputs: Any, labels: Any, err: Exception
                   ) -> Exception:
    """``err`` from a metric's update, naming the metric (its log key and ``kind``: its class,
    or the Keras name it is built from) and what it was given, so it does not read as the
    module's or the loss's failure."""
    def shapes(tree: Any) -> str:
        return ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
                         for t in tree_leaves(tree)) or "none"

    fix = ("build the metric for this model's outputs (e.g. num_classes equal to the size "
           "of its last layer) or leave it out of compile(metrics=...)")
    if _class_last(outputs, labels):
        fix = ("these outputs look class-last (batch, length, classes) against per-token "
               "targets, and metrics read the classes on axis 1, as torch's losses do: return "
               "logits.transpose(1, 2) from the module, or compile(loss=None) with a module "
               "that computes its own loss (its outputs' logits are then read class-last, "
               "one row per token, -100 dropped)")
    return reworded(err, (
        f"metrics: {name!r} ({kind}) failed to update on outputs "
        f"{shapes(outputs)} and targets {shapes(labels)}: {type(err).__name__}: "
        f"{first_line(err)}. Fix: {fix}."), ValueError)


def _class_last(outputs: Any, labels: Any) -> bool:
    """Whether ``outputs`` is one tensor of per-token class scores, class last, for
    ``labels`` (its shape but the last axis)."""
    return (isinstance(outputs, torch.Tensor) and isinstance(labels, torch.Tensor)
            and outputs.dim() >= 3 and outputs.shape[:-1] == labels.shape)


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
    return state_on_device(metric.metric_state, device)


def _tensors(value: Any, count: int) -> bool:
    return (isinstance(value, (list, tuple)) and len(value) == count
            and all(isinstance(t, torch.Tensor) for t in value))


def _copied(state: Mapping[str, Any]) -> dict[str, Any]:
    """A ``metric_state`` that later updates do not change."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else list(v) for k, v in state.items()}
