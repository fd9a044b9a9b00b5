"""Hugging Face ``datasets`` (a ``Dataset`` or an ``IterableDataset``) read by duck typing:
fitdp never imports ``datasets``. Columns the model's ``forward`` does not take are dropped
once, with one note (``Trainer``'s ``remove_unused_columns``), and rows are batched by the
user's collator (``Trainer(data_collator=)``) or stacked as they are.

Example:
    >>> rows = [{"input_ids": [1, 2], "label": 0}, {"input_ids": [3, 4], "label": 1}]
    >>> stack_rows(rows)
    {'input_ids': tensor([[1, 2],
            [3, 4]]), 'labels': tensor([0, 1])}
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fitdp.checks import FitdpWarning, closest, fail

# Label columns a collator renames to ``labels`` (transformers' default_data_collator), kept
# as Trainer keeps them (``_set_signature_columns_if_needed``).
LABEL_COLUMNS = ("label", "label_ids")


def is_hf_dataset(x: Any) -> bool:
    """A ``datasets.Dataset`` or ``datasets.IterableDataset`` (what both have, and no torch
    dataset has), without importing ``datasets``."""
    return (hasattr(x, "column_names") and hasattr(x, "features")
            and callable(getattr(x, "remove_columns", None)))


def is_map_style(x: Any) -> bool:
    """A ``datasets.Dataset`` (rows by index), not a stream."""
    return callable(getattr(x, "__getitem__", None)) and callable(getattr(x, "__len__", None))


Collate = Callable[[list[Any]], Any]


def without_unused(dataset: Any, keep: frozenset[str] | None, name: str,
                   collate_fn: Collate) -> tuple[Any, Collate]:
    """``dataset`` without the columns the forward does not take (``keep``: its argument
    names; None keeps every column), and the collate function to batch it with: a stream
    whose columns are not known yet (an ``IterableDataset`` after ``map``) drops them row by
    row before ``collate_fn``. One FitdpWarning names the dropped columns."""
    if keep is None:
        return dataset, collate_fn
    keep = keep | set(LABEL_COLUMNS)
    columns = dataset.column_names
    if columns is None:
        return dataset, _DropKeys(collate_fn, keep, name)
    unused = _unused(columns, keep, name)
    if unused:
        _note(name, unused)
        dataset = dataset.remove_columns(unused)
    return dataset, collate_fn


def _unused(columns: Sequence[str], keep: frozenset[str], name: str) -> list[str]:
    """The columns no forward argument is named like.

    Raises:
        ValueError: a column close to an argument (``atention_mask``): dropped, the model
            would train without it, silently.
    """
    unused = [c for c in columns if c not in keep]
    for column in unused:
        close = closest(column, keep)
        if close is not None:
            fail(name, f"the column {column!r}", f"columns named as the model's forward "
                 f"arguments ({', '.join(sorted(keep))})", f"did you mean {close!r}? "
                 f"dataset.rename_column({column!r}, {close!r})", described=True)
    return unused


def _note(name: str, unused: Sequence[str]) -> None:
    warnings.warn(f"{name}: the columns {', '.join(map(repr, unused))} are not arguments of "
                  "the model's forward and are dropped (Trainer's remove_unused_columns). A "
                  "collator that needs them: batch the dataset with your own DataLoader("
                  "dataset, collate_fn=...), which fitdp reads as it is.",
                  FitdpWarning, stacklevel=2)


class _DropKeys:
    """A collate function that first drops the keys the forward does not take from each row
    (a stream whose columns are known only from its rows), noting them once."""

    def __init__(self, collate_fn: Collate, keep: frozenset[str],
                 name: str) -> None:
        self.collate_fn, self.keep, self.name, self.noted = collate_fn, keep, name, False

    def __call__(self, rows: list[Any]) -> Any:
        if rows and isinstance(rows[0], Mapping):
            if not self.noted:
                self.noted = True
                unused = _unused(list(rows[0]), self.keep, self.name)
                if unused:
                    _note(self.name, unused)
            rows = [{k: v for k, v in r.items() if k in self.keep} for r in rows]
        return self.collate_fn(rows)


def stack_rows(rows: list[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """Rows of equal-length values stacked into a dict batch, ``label``/``label_ids`` named
    ``labels`` (what transformers' ``default_data_collator`` does): the batching of a Hugging
    Face dataset without ``collate_fn``.

    Raises:
        ValueError: rows of different lengths (naming ``collate_fn`` and a padding collator).
    """
    batch: dict[str, torch.Tensor] = {}
    for key in rows[0]:
        values = [r[key] for r in rows]
        try:
            if isinstance(values[0], torch.Tensor):
                stacked = torch.stack(values)
            else:
                stacked = torch.as_tensor(np.asarray(values) if isinstance(values[0], np.ndarray)
                                          else values)
        except (RuntimeError, ValueError, TypeError) as err:
            fail("collate_fn", f"None, and rows whose {key!r} cannot be stacked ({err})",
                 "a collate function for rows of different lengths",
                 "pass collate_fn=DataCollatorWithPadding(tokenizer) (or another collator "
                 "that pads)", described=True)
        batch["labels" if key in LABEL_COLUMNS else key] = stacked
    return batch
