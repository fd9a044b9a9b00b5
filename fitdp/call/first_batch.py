"""Checks made once per call on its first batch, before the first optimizer step: a dict
batch's keys are arguments of the forward, the outputs and targets fit the loss, the
validation data is shaped like the training data, and which errors are fitdp's own (its
messages are already clear) or the user's (explained with what the batch held)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from fitdp.checks import closest, fail, forward_signature
from fitdp.data.batch import DataBatch, tree_leaves, tree_structure
from fitdp.data.sources import DataSource

# the package's folder (this file is in fitdp/call/): an error raised anywhere in fitdp
_FITDP_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


@dataclasses.dataclass(frozen=True)
class ForwardArguments:
    """The argument names of a module's ``forward``, read once per call: a dict batch's and
    ``forward_kwargs``' keys are checked against them at the first batch, and a Hugging Face
    dataset keeps only these columns (``columns``).

    Example:
        >>> import torch
        >>> ForwardArguments.read(torch.nn.Linear(2, 2)).names
        ('input',)
    """

    owner: str  # "BertForSequenceClassification.forward"
    names: tuple[str, ...]
    open: bool  # the forward takes **kwargs

    @classmethod
    def of(cls, model: Any) -> ForwardArguments | None:
        """The forward of ``model.module``; None for a model with its own steps (they call
        the module as they like)."""
        return None if getattr(model, "steps_overridden", False) else cls.read(model.module)

    @classmethod
    def read(cls, module: Any) -> ForwardArguments | None:
        """``module.forward``'s named arguments (None when it has no signature to read)."""
        signature = forward_signature(module)
        if signature is None:
            return None
        params = signature.parameters.values()
        names = tuple(p.name for p in params if p.kind in (
            p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        return cls(f"{type(module).__name__}.forward", names,
                   any(p.kind is p.VAR_KEYWORD for p in params))

    @property
    def columns(self) -> frozenset[str] | None:
        """The columns a Hugging Face dataset keeps (None: a forward of ``**kwargs`` alone
        names none, so every column is kept)."""
        return frozenset(self.names) if self.names else None

    def check_keys(self, data: Any, forward_kwargs: Mapping[str, Any] | None) -> None:
        """Every key of a dict batch and of ``forward_kwargs`` is an argument of the forward.
        A forward with ``**kwargs`` takes any key, so there a key is refused only when it is
        close to an argument it does not name (``atention_mask``): a transformers model
        swallows such a typo and trains without the argument, silently.

        Raises:
            ValueError: naming the key, the closest argument and the forward.
        """
        for where, keys in (("x", data if isinstance(data, Mapping) else ()),
                            ("forward_kwargs", forward_kwargs or ())):
            for key in keys:
                if not isinstance(key, str) or key in self.names:
                    continue
                close = closest(key, self.names)
                if self.open and close is None:
                    continue  # the forward's **kwargs may read it
                fix = (f"did you mean {close!r}? Rename the key" if close else
                       "drop the key, or rename it to one of the arguments")
                swallows = (" (it takes **kwargs, which would swallow a misspelt argument "
                            "silently)") if self.open else ""
                fail(where, f"the key {key!r}", f"arguments of {self.owner} "
                     f"({', '.join(self.names)}){swallows}", fix, described=True)


def check_outputs(objective: Any, outputs: Any, batch: DataBatch, source: DataSource,
                  val: DataSource | None) -> None:
    """The first batch's ``outputs`` are what ``objective`` takes (logits, not
    probabilities), every target of ``source`` is in range (the whole in-memory label
    tensor when the source knows it), and ``val`` is shaped like the training data."""
    objective.check_outputs(outputs)
    labels = source.plan().targets
    problem = objective.label_problem(outputs, batch.label if labels is None else labels)
    if problem:
        fail("y", problem, "class indices below the number of outputs",
             "check the labels, or the size of the model's last layer", described=True)
    if val is not None:
        check_validation(val, batch, source, objective, outputs)


def raised_in_fitdp(err: BaseException) -> bool:
    """Whether ``err`` was raised by fitdp's own code (its messages are already clear)."""
    tb = err.__traceback__
    last = None
    while tb is not None:
        last = tb
        tb = tb.tb_next
    return last is not None and os.path.abspath(last.tb_frame.f_code.co_filename).startswith(
        _FITDP_DIR)


def check_validation(val: DataSource, batch: DataBatch, source: DataSource, objective: Any,
                     outputs: Any) -> None:
    """Validation data like the training data of ``source`` (whose first batch is
    ``batch``), checked before the first step: structure, dtypes, ranks and target range
    always; the sizes after the rows only when both are in-memory tensors (``_fixed_shapes``):
    a source that brings its own batches may pad each to its longest sequence, so two first
    batches of different lengths say nothing about the data."""
    sample = first_batch(val)
    if sample is None:
        return
    whole = _fixed_shapes(source) and _fixed_shapes(val)
    for part, ours, theirs in (("inputs", batch.data, sample.data),
                               ("targets", batch.label, sample.label)):
        if tree_structure(ours) != tree_structure(theirs) or (
                _form(ours, whole) != _form(theirs, whole)):
            fail("validation_data", f"{part} {_describe(theirs)}",
                 f"{part} shaped like the training {part} {_describe(ours)}" + (
                     "" if whole else " in rank and dtype (their lengths may differ)"),
                 "pass validation data in the same form as x and y", described=True)
    if sample.label is not None:
        try:
            objective.check_targets(sample.label)
        except ValueError as err:
            raise ValueError(f"validation_data: {err}") from None
        labels = val.plan().targets
        problem = objective.label_problem(outputs, sample.label if labels is None else labels)
        if problem:
            fail("validation_data", problem, "class indices below the number of outputs",
                 "check the validation labels", described=True)


def first_batch(source: DataSource) -> DataBatch | None:
    """The first batch of a validation source, without moving it (None when it cannot be
    read twice, like a generator)."""
    if not source.plan().replayable:
        return None
    state = source.state_dict()
    source.set_epoch(0)
    batch = next(iter(source), None)
    source.load_state_dict(state)
    return batch


def _fixed_shapes(source: DataSource) -> bool:
    """Whether every batch of ``source`` has one shape after its rows: in-memory tensors,
    which fitdp slices into batches (their plan fixes ``rows_per_step``). A source that brings
    its own batches (a DataLoader's ``collate_fn``, a generator, a ``BucketIterator``) may pad
    each batch to its longest sequence, as Hugging Face's ``DataCollatorWithPadding`` does."""
    return source.plan().rows_per_step is not None


def _form(tree: Any, whole: bool) -> Any:
    """Each leaf's dtype with its shape after the rows (``whole``) or its rank."""
    return [(tuple(t.shape[1:]) if whole else t.dim(), t.dtype) for t in tree_leaves(tree)]


def _describe(tree: Any) -> str:
    return ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
                     for t in tree_leaves(tree)) or "none"
