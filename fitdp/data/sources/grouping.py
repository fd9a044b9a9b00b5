"""``fit(group_by_length=...)``: each row's length, read once per call from what the user
named, so that ``BucketBatchSampler`` batches rows of similar length together (``Trainer``'s
``group_by_length``: a collator then pads each batch to its own longest row, which is short).

Example:
    >>> rows = [{"input_ids": [5, 6, 7]}, {"input_ids": [5]}]
    >>> row_lengths(rows, True, name="x").tolist()
    [3, 1]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fitdp.checks import closest, fail
from fitdp.data.length_groups import as_lengths

# What ``group_by_length=True`` reads, as Trainer does: a column of lengths when the dataset
# has one (``length_column_name``), else the length of the model's first input.
LENGTH_COLUMN, INPUT_COLUMN = "length", "input_ids"
_FORMS = ("True (the 'length' column, else each row's 'input_ids'), a column or key name, or "
          "one length per row")


def row_lengths(x: Any, group_by_length: Any, *, name: str) -> torch.Tensor | None:
    """Each row's length (a 1-D int64 tensor), or None when ``group_by_length`` is off.

    ``x`` is a map-style dataset: a ``datasets.Dataset``, a torch ``Dataset`` or a list of
    rows. ``group_by_length`` is False/None (off), True, a column/key name (its values are
    lengths, or sequences whose lengths are taken), or one length per row.

    Raises:
        TypeError, ValueError: naming ``group_by_length``, what was received and the fix.
    """
    if group_by_length is None or group_by_length is False:
        return None
    rows = len(x)
    lengths: Any = group_by_length
    if group_by_length is True or isinstance(group_by_length, str):
        column = _column(x, group_by_length, name)
        values = x[column] if _is_table(x) else [_key(x[i], column, i, name)
                                                 for i in range(rows)]
        lengths = [_length(v, column, i) for i, v in enumerate(values)]
    elif not isinstance(group_by_length, (Sequence, torch.Tensor, np.ndarray)) or isinstance(
            group_by_length, (bytes, bytearray)):
        fail("group_by_length", group_by_length, _FORMS, error=TypeError)
    out = as_lengths(lengths, "group_by_length")
    if len(out) != rows:
        fail("group_by_length", f"{len(out)} lengths", f"one per row of {name} ({rows} rows)",
             "pass one length per row, in the rows' order", described=True)
    return out


def _is_table(x: Any) -> bool:
    """A ``datasets.Dataset``: a column is read whole, at once."""
    return isinstance(getattr(x, "column_names", None), list)


def _column(x: Any, asked: bool | str, name: str) -> str:
    """The column (key) ``asked`` names; True: ``length`` where the dataset has that column,
    else ``input_ids``. A name the rows lack is a ValueError naming the closest one."""
    names = list(x.column_names) if _is_table(x) else _keys(x, name)
    column = asked if isinstance(asked, str) else (
        LENGTH_COLUMN if LENGTH_COLUMN in names else INPUT_COLUMN)
    if column not in names:
        near = closest(column, names)
        fail("group_by_length", f"{asked!r}, and the rows of {name} have no {column!r} "
             f"(they have {names})", "a column or key of the rows that holds each row's "
             "tokens or length", f"did you mean {near!r}?" if near else
             "pass group_by_length='<column>', or one length per row", described=True)
    return column


def _keys(x: Any, name: str) -> list[str]:
    """The keys of a dataset's first row (rows that are no dicts: a ValueError)."""
    first = x[0]
    if not isinstance(first, Mapping):
        fail("group_by_length", f"a column name, and the rows of {name} are "
             f"{type(first).__name__}, not dicts", "dict rows to read a column of",
             "pass one length per row: group_by_length=[len(r) for r in rows]",
             described=True)
    return list(first)


def _key(row: Any, column: str, i: int, name: str) -> Any:
    if not isinstance(row, Mapping) or column not in row:
        fail("group_by_length", f"{column!r}, and row {i} of {name} has no such key",
             f"every row with {column!r}", "give every row the key, or pass one length "
             "per row", described=True)
    return row[column]


def _length(value: Any, column: str, i: int) -> int:
    """A length (an int) or the length of a sequence (its first axis)."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim == 0:
        return int(value)
    if not hasattr(value, "__len__"):
        fail("group_by_length", f"{column!r}, whose value in row {i} is "
             f"{type(value).__name__}", "an int (the row's length) or a sequence (its "
             "tokens)", "name a column of token lists or of lengths", described=True)
    return len(value)
