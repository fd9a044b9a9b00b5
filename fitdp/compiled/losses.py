"""Losses: the forms ``compile(loss=..., loss_weights=...)`` accepts, as one objective, and the
checks made on targets before any weight changes."""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.nn import functional as F

from fitdp.checks import FitdpWarning, check_number, fail, first_line, reworded
from fitdp.compiled.keras_names import BINARY_LOSSES, LOSS_ALIASES, canonical_loss, check_outputs
from fitdp.data.batch import tree_leaves, tree_names

# Every name takes logits; Keras's names (keras_names.LOSS_ALIASES) are these too.
LOSSES: dict[str, Callable[..., torch.Tensor]] = {
    "cross_entropy": F.cross_entropy,
    "categorical_crossentropy": F.cross_entropy,  # float rows of class probabilities
    "mse": F.mse_loss,
    "l1": F.l1_loss,
    "bce_with_logits": F.binary_cross_entropy_with_logits,
    "huber": F.huber_loss,
}
_FLOAT_TARGETS = ("mse", "l1", "bce_with_logits", "categorical_crossentropy", "huber")
LossArg = str | nn.Module | Callable[[Any, Any], torch.Tensor]


class Loss:
    """One loss: ``(outputs, targets) -> mean over the batch``, and, when it can, the same
    loss per sample for sample weights."""

    def __init__(self, spec: LossArg, name: str) -> None:
        self.spec, self.name = spec, name
        if isinstance(spec, str):
            self.spec = spec = canonical_loss(spec)
            if spec not in LOSSES:
                fail(name, self.spec, f"one of {sorted({*LOSSES, *LOSS_ALIASES})} (all on "
                     f"logits), an nn.Module or a callable(outputs, targets) -> scalar tensor")
            self.fn = LOSSES[spec]
            self.per_sample: Callable[..., torch.Tensor] | None = functools.partial(
                self.fn, reduction="none")
        elif callable(spec):
            self.fn = spec
            self.per_sample = None
            if isinstance(spec, nn.Module) and isinstance(getattr(spec, "reduction", None), str):
                unreduced = copy.copy(spec)
                setattr(unreduced, "reduction", "none")  # noqa: B010 - typed as a tensor attr
                self.per_sample = unreduced
        else:
            fail(name, spec, "a name such as 'cross_entropy', an nn.Module or a "
                 "callable(outputs, targets) -> scalar tensor", error=TypeError)

    def __call__(self, outputs: Any, targets: Any, weight: torch.Tensor | None = None
                 ) -> torch.Tensor:
        if weight is None:
            return self.fn(outputs, targets)
        if self.per_sample is None:
            raise ValueError(self.no_weights_message())
        # Keras's "sum_over_batch_size": per-sample losses (mean over any other axis) times
        # their weights, averaged over the batch.
        per = self.per_sample(outputs, targets)
        per = per.reshape(per.shape[0], -1).mean(1) if per.dim() > 1 else per
        return (per * weight.to(per.dtype)).mean()

    def counts(self, targets: Any) -> torch.Tensor | None:
        """What this loss's batch mean divides by when it is not the rows: the targets it
        does not ignore (weighted by class weight), for class-index losses; what a loss
        that declares its denominator counts (``fitdp.data.sequence.TokenMean``); else None."""
        declared = _declared_counts(self.spec)
        if declared is not None:
            return declared(targets)
        ignore, weight = _ignore_index(self.spec), getattr(self.spec, "weight", None)
        if ignore is None or not isinstance(targets, torch.Tensor) or targets.is_floating_point():
            return None
        kept = targets != ignore
        if isinstance(weight, torch.Tensor):
            return (weight.to(targets.device)[targets.clamp(min=0)] * kept).sum()
        return kept.sum()

    def no_weights_message(self) -> str:
        return (f"{self.name}: got {self.spec!r}, which only gives the batch mean; sample_weight"
                f" and class_weight need per-sample losses. Fix: use a named loss or an "
                f"nn.Module loss with a `reduction` attribute (e.g. nn.CrossEntropyLoss()).")

    def check_targets(self, targets: Any) -> None:
        """Target dtypes a named loss cannot use, caught before any weight changes."""
        if not isinstance(targets, torch.Tensor):
            return
        if not isinstance(self.spec, str):
            warn_undeclared_tokens(self.name, self.spec, targets)
            return
        if self.spec == "cross_entropy" and targets.is_floating_point():
            fail(f"{self.name}='cross_entropy'",
                 f"{targets.dtype} targets of shape {tuple(targets.shape)}",
                 "integer class indices (torch.long)", "pass y.long(), or for soft labels "
                 "compile with loss='categorical_crossentropy'", described=True)
        if self.spec in _FLOAT_TARGETS and not targets.is_floating_point():
            fail(f"{self.name}={self.spec!r}", f"{targets.dtype} targets",
                 "floating-point targets", "pass y.float()", described=True)

    @property
    def binary(self) -> bool:
        """A binary loss (float targets of several columns are multilabel, for metrics)."""
        return self.spec in BINARY_LOSSES or isinstance(
            self.spec, (nn.BCEWithLogitsLoss, nn.BCELoss))

    def check_outputs(self, outputs: Any) -> None:
        """A named loss given probabilities instead of logits: refused, or warned about."""
        if isinstance(self.spec, str):
            check_outputs(self.spec, outputs, self.name)

    def label_problem(self, outputs: Any, targets: Any) -> str | None:
        """For class-index losses: the first target outside ``[0, classes)`` (the ignore
        index excepted), given outputs of the model; None when all are in range."""
        ignore = _ignore_index(self.spec)
        if ignore is None or not isinstance(outputs, torch.Tensor):
            return None
        if not isinstance(targets, torch.Tensor) or targets.is_floating_point():
            return None
        classes = outputs.shape[1] if outputs.dim() >= 2 else outputs.shape[0]
        bad = ((targets < 0) & (targets != ignore)) | (targets >= classes)
        if not bool(bad.any()):
            return None
        where = tuple(int(i) for i in bad.nonzero()[0])
        value = int(targets[where])
        return (f"target {value} at index {where[0] if len(where) == 1 else where} is outside "
                f"[0, {classes}) for a model with {classes} outputs (ignore index {ignore})")


class Objective:
    """``compile(loss=..., loss_weights=...)`` as ``(outputs, targets[, sample_weight])``.

    One loss, or a list/dict of losses for a module with several outputs (matched by
    position or key with its outputs and targets), summed with ``loss_weights``.

    Example:
        >>> obj = Objective(["mse", "l1"], loss_weights=[1.0, 0.5])
        >>> out = (torch.zeros(2, 1), torch.zeros(2, 1))
        >>> float(obj(out, (torch.ones(2, 1), torch.ones(2, 1))))
        1.5
    """

    def __init__(self, loss: LossArg | Sequence[LossArg] | Mapping[str, LossArg],
                 loss_weights: Sequence[float] | Mapping[str, float] | None = None) -> None:
        self.spec = loss
        self.keys: list[Any] | None = None
        if isinstance(loss, Mapping):
            self.keys = list(loss)
            self.losses = [Loss(loss[k], f"loss[{k!r}]") for k in self.keys]
        elif isinstance(loss, (list, tuple)):
            self.keys = list(range(len(loss)))
            self.losses = [Loss(v, f"loss[{i}]") for i, v in enumerate(loss)]
        else:
            self.losses = [Loss(cast(LossArg, loss), "loss")]
        if self.keys is not None and not self.keys:
            fail("loss", loss, "a loss, or a non-empty list/dict of losses")
        self.weights = _loss_weights(loss_weights, self.keys)
        self.single = self.keys is None and self.weights is None
        # ``(outputs, targets) -> loss`` without sample weights: one loss is its own function
        # (every step: two calls fewer).
        self.unweighted: Callable[[Any, Any], torch.Tensor] = (
            self.losses[0].fn if self.single else self)

    @property
    def supports_sample_weight(self) -> bool:
        return all(loss.per_sample is not None for loss in self.losses)

    def counts(self, targets: Any) -> torch.Tensor | None:
        """The counted targets of a single loss without weights (see ``Loss.counts``); None
        (mean over rows) for several losses or sample weights."""
        return self.losses[0].counts(targets) if self.single else None

    @property
    def declared_counts(self) -> Callable[[Any], torch.Tensor] | None:
        """What a custom step's slices weigh by: the counts of a loss that says what it
        averages over (``TokenMean``, a ``counts`` method), never a named loss's ignore
        index (the step may not call compile's loss at all); None: rows."""
        return _declared_counts(self.losses[0].spec) if self.single else None

    def warn_custom_step_rows(self, targets: Any) -> None:
        """Warn, on a custom step's first batch, when compile's loss would count targets it
        ignores (-100) but does not declare it: the step's slices weigh by rows, since the
        step may never call compile's loss (``declared_counts``)."""
        if (self.declared_counts is not None or self.counts(targets) is None
                or not isinstance(targets, torch.Tensor)
                or not bool((targets == -100).any())):
            return
        warnings.warn(
            f"loss: a custom train_step's slices weigh by rows, and compile's {self.spec!r} "
            f"ignores the -100 targets of these labels; if the step returns compile's loss "
            f"(compute_loss), several devices train another update than one. Fix: declare "
            f"what it averages over: compile(loss=fitdp.TokenMean(fn)), or compile(loss=None,"
            f" loss_items='tokens') for a step that returns a model's own loss.",
            FitdpWarning, stacklevel=2)

    def no_weights_message(self) -> str:
        return next(loss.no_weights_message() for loss in self.losses if loss.per_sample is None)

    def __call__(self, outputs: Any, targets: Any, weight: torch.Tensor | None = None
                 ) -> torch.Tensor:
        if self.single:
            return self.losses[0](outputs, targets, weight)
        if self.keys is None:
            return self.losses[0](outputs, targets, weight) * self.weights[0]  # type: ignore[index]
        total: Any = 0.0
        for i, (key, loss) in enumerate(zip(self.keys, self.losses)):
            w = 1.0 if self.weights is None else self.weights[i]
            total = total + w * loss(_pick(outputs, key, "outputs"), _pick(targets, key, "y"),
                                     weight)
        return total

    def _per_loss(self, tree: Any, name: str) -> list[tuple[Loss, Any]]:
        """Each loss with its part of ``tree`` (the outputs or the targets)."""
        if self.keys is None:
            return [(self.losses[0], tree)]
        return [(loss, _pick(tree, key, name)) for key, loss in zip(self.keys, self.losses)]

    def check_targets(self, targets: Any) -> None:
        for loss, part in self._per_loss(targets, "y"):
            loss.check_targets(part)

    def binary_outputs(self) -> dict[Any, bool]:
        """Output key (None: the only output) -> whether its loss is binary."""
        if self.keys is None:
            return {None: self.losses[0].binary}
        return {k: loss.binary for k, loss in zip(self.keys, self.losses)}

    def check_outputs(self, outputs: Any) -> None:
        """Each named loss's outputs are logits, not probabilities (see ``Loss``)."""
        for loss, part in self._per_loss(outputs, "outputs"):
            loss.check_outputs(part)

    def label_problem(self, outputs: Any, targets: Any) -> str | None:
        if self.keys is None:
            return self.losses[0].label_problem(outputs, targets)
        for key, loss in zip(self.keys, self.losses):
            problem = loss.label_problem(_pick(outputs, key, "outputs"), _pick(targets, key, "y"))
            if problem:
                return f"{loss.name}: {problem}"
        return None


def _declared_counts(spec: Any) -> Callable[[Any], torch.Tensor] | None:
    """The ``counts(targets)`` of a custom loss that says what its mean divides by (a
    ``TokenMean``, or any callable with that method); None for the others."""
    if isinstance(spec, str):
        return None
    counts = getattr(spec, "counts", None)
    return counts if callable(counts) else None


def warn_undeclared_tokens(name: str, spec: Any, targets: torch.Tensor) -> None:
    """Warn when a custom loss that does not say what it averages over gets per-token labels
    padded with -100: it is weighed by rows (sequences) on several devices and in the logged
    loss, while it likely averages tokens. One op on the first batch of a call."""
    if (_declared_counts(spec) is not None or _ignore_index(spec) is not None
            or targets.is_floating_point() or targets.dim() < 2
            or not bool((targets == -100).any())):
        return
    warnings.warn(
        f"{name}: {spec!r} gets per-token labels padded with -100 but does not say what it "
        f"averages over, so several devices and the logged loss weigh it by rows (sequences)"
        f"; a mean over tokens then trains another update on several devices. Fix: "
        f"compile(loss=fitdp.TokenMean(fn)) (or give it a counts(targets) method).",
        FitdpWarning, stacklevel=2)


def _ignore_index(spec: Any) -> int | None:
    """The ignore index of a class-index loss (torch's default -100), else None."""
    if isinstance(spec, str):
        return -100 if spec == "cross_entropy" else None
    if isinstance(spec, (nn.CrossEntropyLoss, nn.NLLLoss)):
        return int(spec.ignore_index)
    return None


def _loss_weights(weights: Any, keys: list[Any] | None) -> list[float] | None:
    if weights is None:
        return None
    if keys is None:
        if isinstance(weights, (list, tuple)) and len(weights) == 1:
            weights = weights[0]
        return [check_number("loss_weights", weights, low=0)]
    if isinstance(weights, Mapping):
        if set(weights) != set(keys):
            fail("loss_weights", sorted(weights, key=str), f"one weight per loss key {keys}",
                 error=ValueError, described=False)
        return [check_number(f"loss_weights[{k!r}]", weights[k], low=0) for k in keys]
    if not isinstance(weights, (list, tuple)) or len(weights) != len(keys):
        fail("loss_weights", weights, f"a list of {len(keys)} numbers, one per loss")
    return [check_number(f"loss_weights[{i}]", w, low=0) for i, w in enumerate(weights)]


def _pick(tree: Any, key: Any, name: str) -> Any:
    try:
        return tree[key]
    except (KeyError, IndexError, TypeError):
        fail(name, f"{type(tree).__name__} without entry {key!r}",
             "one entry per loss (a tuple/list or dict of the module's outputs and targets)",
             "make the module return, and y hold, one entry per loss", described=True)


def explain_failure(err: Exception, batch: Any, origin: str) -> Exception:
    """``err`` from the module or loss on a call's first batch, with context: where the batch
    came from, its shapes and dtypes and the likely fix; ``err`` stays the cause."""
    def describe(tree: Any, prefix: str) -> str:
        return ", ".join(f"{n} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
                         for n, t in zip(tree_names(tree, prefix), tree_leaves(tree))) or "none"

    text = first_line(err)
    hint = "check that the data matches what the module's forward and the loss expect"
    ints = [t for t in tree_leaves(batch.data) if not t.is_floating_point()]
    if ints and ("dtype" in text or "scalar type" in text or "Long" in text):
        hint = ("the inputs are integers but the layer computes in floats: pass x.float() "
                "(integer inputs are for embeddings)")
    elif "shapes cannot be multiplied" in text or "size mismatch" in text:
        hint = "the inputs' last dimension does not match the first layer's in_features"
    elif "out of bounds" in text or "Target" in text:
        hint = "the targets do not match the model's outputs (class indices < number of outputs)"
    elif isinstance(batch.data, Mapping):
        hint = (f"a dict batch is passed as module(**batch): its keys {list(batch.data)} must "
                f"be the names of the forward's arguments (input_ids, attention_mask, labels "
                f"for a Hugging Face model)")
    message = (f"{origin}: the module's forward or the loss failed on the first batch: "
               f"{type(err).__name__}: {text}. The batch came from {origin}: inputs "
               f"{describe(batch.data, 'x')}; targets {describe(batch.label, 'y')}. "
               f"Likely fix: {hint}.")
    return reworded(err, message)
