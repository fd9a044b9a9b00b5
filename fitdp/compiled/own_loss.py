"""``compile(loss=None)``: the module computes its own loss (a Hugging Face model given
``labels``), and ``loss_items`` says what that loss averages over, so that the slices of a
batch on several devices and ranks are weighed as the one-device, whole-batch update.

A module's own loss is a mean, over the batch's rows for a sequence classifier, over its
tokens that are not ignored (-100) for a token classifier or a causal language model. A
slice's mean weighed by its rows then gives another update than the whole batch as soon as
the slices hold different numbers of tokens; weighed by its items (``ItemCount``), it gives
the same. The executor reads the count of every slice (``fitdp.executor.weighing``, which
calls an ``ItemCount`` with the slice's inputs and labels: ``reads_inputs``).
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from fitdp.checks import FitdpWarning, describe, fail, forward_signature
from fitdp.data.batch import batch_labels

IGNORE_INDEX = -100  # what torch's cross_entropy and Hugging Face's losses ignore
ITEMS = ("tokens", "causal_lm")
LossItems = str | Callable[[Any], Any] | None
# transformers' heads by the end of their class name -> what their loss averages over (None:
# the rows). Read from the names, so fitdp needs no import of transformers to know them.
HEADS = {"ForCausalLM": "causal_lm", "LMHeadModel": "causal_lm", "ForMaskedLM": "tokens",
         "ForTokenClassification": "tokens", "ForSequenceClassification": None}


def head_of(module: Any) -> tuple[str, str | None] | None:
    """``(class name, loss_items it needs)`` of a transformers model with a known head (the
    first class of its type's MRO that transformers defines: a user's subclass counts),
    or None for any other module.

    Example:
        >>> head_of(torch.nn.Linear(2, 2)) is None
        True
    """
    for cls in type(module).__mro__:
        if cls.__module__.startswith("transformers."):
            for suffix, items in HEADS.items():
                if cls.__name__.endswith(suffix):
                    return cls.__name__, items
            return None
    return None


class ItemCount:
    """What a module's own loss averages over in a slice (``compile(loss_items=...)``).

    Called ``count(data, labels)`` with the slice's inputs (the dict a Hugging Face model
    takes as ``module(**data)``) and its separate targets (None when they are in the dict).

    Args:
        spec: ``"tokens"`` (labels that are not -100), ``"causal_lm"`` (labels after the
            first position that are not -100: what a causal LM averages over once it
            shifts them), or a callable given the slice (the dict; ``(x, y)`` when the
            data has separate targets) that returns the count (an int or an integer
            tensor). A name counts None for a batch without labels (predict).

    Raises:
        ValueError, TypeError: an unknown name, or neither a name nor a callable.

    Example:
        >>> count = ItemCount("causal_lm")
        >>> int(count({"labels": torch.tensor([[1, 2, -100], [3, -100, -100]])}, None))
        2
    """

    reads_inputs = True  # the executor hands it the slice's inputs and targets

    def __init__(self, spec: str | Callable[[Any], Any]) -> None:
        if isinstance(spec, str):
            if spec not in ITEMS:
                fail("loss_items", spec, f"one of {list(ITEMS)}, or a callable(batch) -> "
                     "count", "pass loss_items='tokens' for a loss over every labelled "
                     "token, 'causal_lm' for a causal LM's shifted labels")
        elif not callable(spec):
            fail("loss_items", spec, f"one of {list(ITEMS)}, or a callable(batch) -> count",
                 error=TypeError)
        self.spec = spec

    def __call__(self, data: Any, labels: Any) -> torch.Tensor | None:
        spec = self.spec
        if callable(spec):
            count = spec(data if labels is None else (data, labels))
            if isinstance(count, torch.Tensor) and not count.is_floating_point() \
                    and not count.is_complex() and count.numel() == 1:
                return count  # (its value is checked on the first batch: no sync per step)
            if isinstance(count, bool) or not isinstance(count, numbers.Integral) \
                    or count < 0:
                self._refuse(count)
            return torch.tensor(int(count))
        targets = batch_labels(data, labels)
        if not isinstance(targets, torch.Tensor):
            return None  # no labels (predict): no loss to weigh
        if spec == "causal_lm":
            targets = targets[..., 1:]
        return (targets != IGNORE_INDEX).sum()

    def check_batch(self, data: Any, labels: Any) -> None:
        """A callable's count for a whole batch (the first, before any step): at least 1.

        Raises:
            TypeError, ValueError: naming ``loss_items`` and what it returned.
        """
        if not callable(self.spec):
            return
        count = self(data, labels)
        if count is not None and int(count) < 1:
            self._refuse(count)

    def _refuse(self, count: Any) -> None:
        error = TypeError if not isinstance(count, (numbers.Integral, torch.Tensor)) or isinstance(
            count, bool) or (isinstance(count, torch.Tensor) and (
                count.is_floating_point() or count.numel() != 1)) else ValueError
        fail("loss_items", f"a callable that returned {describe(count)}", "a count of the "
             "items the module's loss averages over: an int >= 1, or a one-element integer "
             "tensor, for the whole batch (0 for a slice with no items)", "return e.g. "
             "int((batch['labels'] != -100).sum()), or pass loss_items='tokens'",
             error=error, described=True)


class OwnLoss:
    """The objective of ``compile(loss=None)``: the module's own ``outputs.loss`` (or
    ``outputs["loss"]``), a scalar mean over the slice.

    Args:
        loss_items: what that loss averages over (see ``ItemCount``), or None: the rows.
        head: ``head_of`` the module: its class name and the ``loss_items`` its loss needs.

    Example:
        >>> OwnLoss(None).loss_of({"loss": torch.tensor(0.5), "logits": torch.zeros(2, 3)})
        tensor(0.5000)
    """

    supports_sample_weight = False

    def __init__(self, loss_items: LossItems,
                 head: tuple[str, str | None] | None = None) -> None:
        self.loss_items = loss_items
        self.head = head
        self.counts = None if loss_items is None else ItemCount(loss_items)
        self.declared_counts = self.counts  # a custom step's slices weigh by it too
        self.unweighted = self

    def __call__(self, outputs: Any, targets: Any = None, weight: Any = None) -> torch.Tensor:
        return self.loss_of(outputs)

    def loss_of(self, outputs: Any) -> torch.Tensor:
        """The loss the module returned.

        Raises:
            ValueError: the outputs hold no loss (naming what they hold and what to pass).
        """
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(
            outputs, "loss", None)
        if not isinstance(loss, torch.Tensor):
            held = (f"outputs with keys {list(outputs)}" if isinstance(outputs, Mapping) else
                    f"outputs of type {type(outputs).__name__}")
            fail("compile(loss=None)", f"{held} and no 'loss'",
                 "a module that returns its own loss (outputs.loss or outputs['loss'], a "
                 "scalar tensor)", "put the labels in the batch (a Hugging Face model "
                 "computes its loss when the batch holds 'labels'), or compile with a loss "
                 "such as loss='cross_entropy' and pass y", described=True)
        return loss

    @property
    def shifts(self) -> bool:
        """Whether the module's loss shifts its labels (a causal LM): ``loss_items``, or where
        it names no mode, the head's."""
        items = self.loss_items if isinstance(self.loss_items, str) else (
            self.head[1] if self.head else None)
        return items == "causal_lm"

    def check_first_batch(self, data: Any, labels: Any, module: nn.Module | None,
                          training: bool) -> None:
        """Before a call's first step: a ``module`` (None: a custom step calls it) whose
        forward takes no ``labels`` cannot compute its loss from them; a ``loss_items``
        callable returns a count; in training, the warning of ``warn_uncounted``.

        Raises:
            TypeError: labels for a forward that takes none (named ``compile(loss=None)``).
            TypeError, ValueError: a bad count (``ItemCount.check_batch``).
        """
        if module is not None and batch_labels(data, labels) is not None \
                and not _takes_labels(module):
            forward = type(module).__name__ + ".forward"
            fail("compile(loss=None)", f"a module whose {forward} takes no labels "
                 f"(signature {_signature(module)})", "a module that computes its own loss "
                 "from labels, as a Hugging Face model's forward(..., labels=None) does",
                 "compile with a loss (e.g. loss='cross_entropy') and pass y, or have the "
                 "forward take labels and return {'loss': ...}", error=TypeError,
                 described=True)
        if self.counts is not None:
            self.counts.check_batch(data, labels)
        if training:
            self.warn_uncounted(data, labels)

    def warn_uncounted(self, data: Any, labels: Any) -> None:
        """Check the first training batch's labels against what the module's loss averages
        over, before any step: ``loss_items`` naming tokens on one label per row is refused;
        a known transformers head given another ``loss_items`` than its loss needs, or none
        where it needs one, is warned about (naming it); so are labels holding -100 with no
        ``loss_items`` (slices and the logged loss are then weighed by rows).

        Raises:
            ValueError: ``loss_items='tokens'`` or ``'causal_lm'`` and one label per row.
        """
        targets = batch_labels(data, labels)
        if not isinstance(targets, torch.Tensor) or targets.is_floating_point():
            return
        items = self.loss_items
        per_token = targets.dim() >= 2
        if items in ITEMS and not per_token:
            fail("loss_items", f"{items!r} and labels of shape {tuple(targets.shape)}, one "
                 f"per row", "per-token labels (batch, length) for a loss over tokens",
                 "loss_items=None for a loss averaged over the rows (a sequence classifier)",
                 described=True)
        named, needed = self.head if self.head else (None, None)
        if named is not None and per_token and needed in ITEMS and items != needed and (
                items is None or isinstance(items, str)):
            given = "loss_items is None (the rows are counted)" if items is None else \
                f"loss_items is {items!r}"
            over = "the labelled tokens" + (
                " after the first (it shifts its labels)" if needed == "causal_lm" else "")
            warnings.warn(
                f"compile(loss=None): {named}'s loss averages over {over}, but {given}, "
                f"so several devices or ranks and the logged loss weigh each slice by "
                f"another count than the model's. Fix: "
                f"compile(loss=None, loss_items={needed!r}).", FitdpWarning, stacklevel=2)
            return
        if self.counts is not None or not bool((targets == IGNORE_INDEX).any()):
            return
        warnings.warn(
            "compile(loss=None): the batch's labels hold -100 (ignored targets) but no "
            "loss_items says what the module's loss averages over, so several devices or "
            "ranks and the logged loss weigh each slice by its rows, while the model "
            "likely averages over tokens: another update than on one device. Fix: "
            "compile(loss=None, loss_items='tokens') (a token classifier, a masked LM) or "
            "loss_items='causal_lm' (a causal LM, which shifts its labels).",
            FitdpWarning, stacklevel=2)

    def check_targets(self, targets: Any) -> None:
        """Nothing to check: the module reads its targets itself."""

    def check_outputs(self, outputs: Any) -> None:
        """Nothing to check: the module computes its loss itself."""

    def label_problem(self, outputs: Any, targets: Any) -> str | None:
        return None

    def binary_outputs(self) -> dict[Any, bool]:
        return {None: False}

    def no_weights_message(self) -> str:
        return ("sample_weight: got per-sample weights with compile(loss=None); expected no "
                "weights (the module averages its own loss). Fix: compile with a loss that "
                "takes per-sample weights, or weigh the loss inside the module.")


def _takes_labels(module: nn.Module) -> bool:
    """Whether ``module``'s forward takes ``labels`` (by name, or through ``**kwargs``)."""
    signature = forward_signature(module)
    if signature is None:  # no signature to read: let the call say
        return True
    params = signature.parameters.values()
    return any(p.name == "labels" or p.kind is p.VAR_KEYWORD for p in params)


def _signature(module: nn.Module) -> str:
    signature = forward_signature(module)
    return "unknown" if signature is None else str(signature)


def own_loss(loss: Any, loss_items: LossItems, module: Any = None) -> OwnLoss | None:
    """``OwnLoss`` for ``compile(loss=None)`` of ``module``; None for a compile loss
    (``loss_items`` then has no meaning and is refused).

    Raises:
        ValueError: ``loss_items`` with a compile loss; an unknown ``loss_items``.
    """
    if loss is None:
        return OwnLoss(loss_items, head_of(module))
    if loss_items is not None:
        fail("loss_items", loss_items, "None when compile has a loss (loss_items says what "
             "the module's own loss averages over)", "compile(loss=None, loss_items=...) "
             "for a module that computes its loss, or drop loss_items")
    return None
