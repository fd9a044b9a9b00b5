"""The loss and metric names Keras users write, as torch losses and torchmetrics metrics.

fitdp's modules return logits, so every loss name takes logits (Keras's ``from_logits=True``)
and every metric name reads logits (``sigmoid`` or ``softmax`` first where a probability is
meant). A metric name's task (binary, multiclass, multilabel or one-hot) is read from the
shapes and dtypes of the first batch's outputs and targets (see ``docs/metrics.md``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F
from torchmetrics import Metric
from torchmetrics.aggregation import MeanMetric
from torchmetrics.classification import (
    BinaryAccuracy,
    BinaryAUROC,
    BinaryPrecision,
    BinaryRecall,
    MulticlassAccuracy,
    MultilabelAccuracy,
)
from torchmetrics.regression import MeanAbsoluteError, MeanSquaredError
from torchmetrics.text import Perplexity

from fitdp.compiled.own_loss import IGNORE_INDEX  # class-index metrics skip it, as the losses

# Keras's loss names -> fitdp's (the same loss on logits).
LOSS_ALIASES: dict[str, str] = {
    "sparse_categorical_crossentropy": "cross_entropy",
    "binary_crossentropy": "bce_with_logits",
    "mean_squared_error": "mse",
    "mean_absolute_error": "l1", "mae": "l1",
}
# Losses whose outputs are one row of class logits per sample (class axis 1, torch's).
SOFTMAX_LOSSES = ("cross_entropy", "categorical_crossentropy")
BINARY_LOSSES = ("bce_with_logits",)
_LOGITS_FIX = ("drop the final softmax/sigmoid layer: fitdp's loss names take logits (Keras's "
               "from_logits=True), or pass a torch loss made for probabilities (nn.NLLLoss on "
               "their log, nn.BCELoss)")

# Keras's metric names. "task" ones read the first batch's outputs and targets.
ACCURACY = ("accuracy", "acc")
TASK_METRICS = (*ACCURACY, "binary_accuracy", "categorical_accuracy",
                "sparse_categorical_accuracy", "top_k_categorical_accuracy",
                "sparse_top_k_categorical_accuracy", "auc", "precision", "recall")
REGRESSION_METRICS = ("mae", "mean_absolute_error", "mse", "mean_squared_error", "rmse",
                      "root_mean_squared_error")
# exp of the mean cross entropy over the labelled targets (a language model's perplexity).
PERPLEXITY = "perplexity"
METRIC_NAMES = (*TASK_METRICS, *REGRESSION_METRICS, PERPLEXITY)
# Names that are a mean of per-sample values, so they take sample weights (weighted_metrics).
WEIGHTABLE = tuple(n for n in METRIC_NAMES if n not in (
    "auc", "precision", "recall", "rmse", "root_mean_squared_error", PERPLEXITY))
TOP_K = 5  # Keras's default k

Prepare = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], tuple[Any, ...]]


def canonical_loss(name: str) -> str:
    """fitdp's name for a loss name (a Keras name or fitdp's own)."""
    return LOSS_ALIASES.get(name, name)


def check_outputs(loss: str, outputs: Any, name: str) -> None:
    """Refuse outputs that clearly are probabilities for a loss that takes logits: rows of
    ``[0, 1]`` summing to 1. (Sigmoid outputs are not told apart: real logits of a batch
    often all lie in ``[0, 1]`` too.)"""
    if not isinstance(outputs, torch.Tensor) or not outputs.is_floating_point() or (
            outputs.dim() < 2 or outputs.numel() == 0):
        return
    out = outputs.detach().float()
    in_unit = bool(((out >= 0) & (out <= 1)).all())
    if loss in SOFTMAX_LOSSES and out.shape[1] > 1 and in_unit and bool(
            torch.allclose(out.sum(1), torch.ones(()), atol=1e-4)):
        raise ValueError(
            f"{name}={loss!r}: got outputs whose rows are probabilities (in [0, 1], each "
            f"summing to 1, shape {tuple(outputs.shape)}); expected logits, which a softmax "
            f"would turn into those. Fix: {_LOGITS_FIX}.")


def task_of(outputs: torch.Tensor, targets: torch.Tensor, binary_loss: bool) -> str:
    """``"binary"``, ``"multiclass"`` (class indices), ``"multilabel"`` or ``"onehot"``
    (float rows of class probabilities), from shapes and dtypes only, so every device's
    slice gives the same answer. The class axis is 1 (torch's)."""
    if outputs.dim() < 2 or outputs.shape[1] == 1:
        return "binary"
    if not targets.is_floating_point():
        return "multiclass"
    return "multilabel" if binary_loss else "onehot"


def build_metric(name: str, outputs: torch.Tensor, targets: torch.Tensor, *,
                 binary_loss: bool, weighted: bool) -> tuple[Metric, Prepare]:
    """The torchmetrics metric for Keras's metric ``name`` on these outputs and targets, and
    how to turn ``(outputs, targets, sample_weight)`` into its ``update`` arguments.

    Raises:
        ValueError: a top-k accuracy on fewer than ``k`` classes.
    """
    if name in REGRESSION_METRICS:
        return _regression(name, weighted)
    if name == PERPLEXITY:
        return _perplexity(outputs, targets)
    task = task_of(outputs, targets, binary_loss)
    if name == "binary_accuracy":
        task = "binary" if task == "binary" else "multilabel"
    elif name == "categorical_accuracy":
        task = "onehot"
    elif name in ("sparse_categorical_accuracy",):
        task = "multiclass"
    classes = 1 if outputs.dim() < 2 else outputs.shape[1]
    k = TOP_K if "top_k" in name else 1
    if k > classes:
        raise ValueError(f"metrics: {name!r} needs at least {k} classes; the outputs have "
                         f"{classes} (shape {tuple(outputs.shape)}). Fix: pass "
                         f"MulticlassAccuracy(num_classes={classes}, top_k=...) instead.")
    if name in ("auc", "precision", "recall"):
        return _flattened(name, task, classes)
    if weighted:
        return MeanMetric(), _weighted_accuracy(task, k)
    if task == "binary":
        return BinaryAccuracy(), lambda o, t, w: (torch.sigmoid(o).reshape(-1), t.reshape(-1))
    if task == "multilabel":
        return (MultilabelAccuracy(num_labels=classes, average="micro"),
                lambda o, t, w: (torch.sigmoid(o), t.long()))
    metric = MulticlassAccuracy(num_classes=classes, average="micro", top_k=k,
                                ignore_index=IGNORE_INDEX)
    if task == "onehot":
        return metric, lambda o, t, w: (o, t.argmax(1))
    return metric, lambda o, t, w: (o, t)


def _regression(name: str, weighted: bool) -> tuple[Metric, Prepare]:
    squared = name in ("mse", "mean_squared_error")
    if weighted:
        def per_sample(o: torch.Tensor, t: torch.Tensor, w: torch.Tensor | None
                       ) -> tuple[Any, ...]:
            diff = o.float() - t.float()
            return _sample_mean(diff * diff if squared else diff.abs()), _weight(w)
        return MeanMetric(), per_sample
    if name in ("rmse", "root_mean_squared_error"):
        return MeanSquaredError(squared=False), lambda o, t, w: (o, t)
    return (MeanSquaredError() if squared else MeanAbsoluteError()), lambda o, t, w: (o, t)


def _perplexity(outputs: torch.Tensor, targets: torch.Tensor) -> tuple[Metric, Prepare]:
    """torchmetrics' ``Perplexity`` (-100 ignored) on class logits of any layout with the
    class axis 1 (a module's own class-last logits come here as rows ``(tokens, C)``): every
    position's logits as one row, in float32.

    Raises:
        ValueError: outputs without a class axis, or float targets.
    """
    if outputs.dim() < 2 or targets.is_floating_point():
        raise ValueError(
            f"metrics: 'perplexity' reads class logits and class-index targets; got outputs "
            f"{tuple(outputs.shape)} and {str(targets.dtype).removeprefix('torch.')} targets "
            f"{tuple(targets.shape)}. Fix: use it on a language model's or a classifier's "
            f"logits, with integer labels (-100 where ignored).")

    def prepare(o: torch.Tensor, t: torch.Tensor, w: torch.Tensor | None) -> tuple[Any, ...]:
        rows = o.movedim(1, -1).reshape(1, -1, o.shape[1]).float()
        return rows, t.reshape(1, -1)

    return Perplexity(ignore_index=IGNORE_INDEX), prepare


def _flattened(name: str, task: str, classes: int) -> tuple[Metric, Prepare]:
    """Keras's AUC, Precision and Recall: every (sample, class) pair as one binary case, on
    probabilities (Keras's ``multi_label=False``); AUC exact, not over 200 thresholds."""
    metric = {"auc": BinaryAUROC, "precision": BinaryPrecision, "recall": BinaryRecall}[name]()

    def prepare(o: torch.Tensor, t: torch.Tensor, w: torch.Tensor | None) -> tuple[Any, ...]:
        if task in ("binary", "multilabel"):
            return torch.sigmoid(o).reshape(-1), t.reshape(-1).long()
        probs = torch.softmax(o.float(), 1)
        hot = F.one_hot(t, classes).movedim(-1, 1) if task == "multiclass" else t
        return probs.reshape(-1), hot.reshape(-1).long()

    return metric, prepare


def _weighted_accuracy(task: str, k: int) -> Prepare:
    """Per-sample accuracy (mean over any other axis) with its weight, for ``MeanMetric``."""
    def prepare(o: torch.Tensor, t: torch.Tensor, w: torch.Tensor | None) -> tuple[Any, ...]:
        if task in ("binary", "multilabel"):
            right = (o > 0).reshape(t.shape) == (t > 0.5)
        else:
            index = t.argmax(1) if task == "onehot" else t
            right = (o.topk(k, 1).indices == index.unsqueeze(1)).any(1)
        return _sample_mean(right.float()), _weight(w)
    return prepare


def _sample_mean(values: torch.Tensor) -> torch.Tensor:
    return values.reshape(values.shape[0], -1).mean(1) if values.dim() > 1 else values


def _weight(w: torch.Tensor | None) -> torch.Tensor | float:
    return 1.0 if w is None else w.float()
