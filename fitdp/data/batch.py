"""`DataBatch` and `DataDesc`: what flows from a data source into the executor manager."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

# A batch's inputs: one tensor, a tuple/list of tensors (``module(*x)``) or a dict
# (``module(**x)``).
Inputs = torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor]


class DataDesc(NamedTuple):
    """Name, shape, dtype and layout of one input, like MXNet's ``DataDesc``.

    Example:
        >>> DataDesc("data", (32, 16), torch.int64)
        DataDesc(name='data', shape=(32, 16), dtype=torch.int64, layout='NT')
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    layout: str = "NT"

    @property
    def batch_axis(self) -> int:
        """The axis of ``N`` in ``layout`` (MXNet's ``DataDesc.get_batch_axis``): 1 for
        time-major ``"TNC"`` data, 0 when the layout names no batch axis."""
        return batch_axis(self.layout)


def batch_axis(layout: str | None) -> int:
    """The batch axis of a layout string: the position of ``N`` (0 for None or no ``N``).

    Example:
        >>> batch_axis("TNC"), batch_axis("NCHW"), batch_axis(None)
        (1, 0, 0)
    """
    return max(layout.find("N"), 0) if layout else 0


def axis_of(t: torch.Tensor, axis: int) -> int:
    """``axis`` for a tensor that has it; 0 for one with fewer dims (per-sample weights and
    labels of time-major data are batch-first)."""
    return axis if t.dim() > axis else 0


Axes = Any  # a batch axis for every tensor (an int), or a tree of ints (``output_axes``)


def output_axes(outputs: Any, axis: int, rows: int, inputs: Any) -> Axes:
    """The batch axis of each output of time-major data (batch ``axis`` > 0): ``axis`` for
    an output that keeps the inputs' layout (the inputs' dims before ``axis``, then
    ``rows``: a tagger's ``(T, N, C)``), 0 for one already batch-first (a classifier's
    ``(N, C)`` of ``(T, N)`` tokens). An output that fits both (``T == N``) or neither keeps
    the layout's ``axis``. Batch-first data: ``axis`` (0) for every tensor.

    Example:
        >>> tokens = torch.zeros(7, 2)
        >>> output_axes((torch.zeros(7, 2, 5), torch.zeros(2, 3)), 1, 2, tokens)
        (1, 0)
    """
    if axis == 0:
        return axis
    lead = next((tuple(t.shape[:axis]) for t in tree_leaves(inputs) if t.dim() > axis), None)

    def one(t: torch.Tensor) -> int:
        if t.dim() <= axis:
            return 0
        keeps = t.shape[axis] == rows and tuple(t.shape[:axis]) == lead
        return 0 if t.shape[0] == rows and not keeps else axis

    return tree_map(one, outputs)


def tree_map_axes(fn: Callable[[torch.Tensor, int], Any], tree: Any, axes: Axes) -> Any:
    """``fn(tensor, its batch axis)`` for every tensor of ``tree``; ``axes`` is one axis
    for all (``axis_of`` each) or a tree of ints of ``tree``'s structure."""
    if isinstance(axes, int):
        return tree_map(lambda t: fn(t, axis_of(t, axes)), tree)
    if isinstance(tree, Mapping):
        return {k: tree_map_axes(fn, v, axes[k]) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return type(tree)(tree_map_axes(fn, v, a) for v, a in zip(tree, axes))
    return tree


def take_rows(tree: Any, rows: slice, axis: Axes = 0) -> Any:
    """``rows`` of every tensor of ``tree`` along the batch ``axis`` (or per-tensor axes)."""
    if axis == 0:
        return tree[rows] if isinstance(tree, torch.Tensor) else tree_map(
            lambda t: t[rows], tree)
    return tree_map_axes(lambda t, a: t[(slice(None),) * a + (rows,)], tree, axis)


def tree_map(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """Apply ``fn`` to every tensor of a tensor, tuple/list or dict of tensors."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, Mapping):
        return {k: tree_map(fn, v) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return type(tree)(tree_map(fn, v) for v in tree)
    return tree


def tree_leaves(tree: Any) -> list[torch.Tensor]:
    """The tensors of a tensor, tuple/list or dict of tensors, in a fixed order."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, Mapping):
        return [t for v in tree.values() for t in tree_leaves(v)]
    if isinstance(tree, (tuple, list)):
        return [t for v in tree for t in tree_leaves(v)]
    return []


def tree_names(tree: Any, prefix: str) -> list[str]:
    """Names for the leaves of ``tree`` (``data``, ``data1``..., or the dict keys)."""
    if isinstance(tree, torch.Tensor):
        return [prefix]
    if isinstance(tree, Mapping):
        return [n for k, v in tree.items() for n in tree_names(v, str(k))]
    if isinstance(tree, (tuple, list)):
        return [n for i, v in enumerate(tree) for n in tree_names(v, f"{prefix}{i}")]
    return []


def tree_structure(tree: Any) -> Any:
    """A hashable description of a tree's nesting and leaf trailing shapes' rank and dtype."""
    if isinstance(tree, torch.Tensor):
        return ("T", tree.dim(), tree.dtype)
    if isinstance(tree, Mapping):
        return ("D", tuple((k, tree_structure(v)) for k, v in tree.items()))
    if isinstance(tree, (tuple, list)):
        return ("L", tuple(tree_structure(v) for v in tree))
    return ("?", type(tree).__name__)


def tree_cat(trees: Sequence[Any], axis: Axes = 0) -> Any:
    """Concatenate a list of same-structure trees along the batch ``axis`` (or per-tensor
    axes)."""
    first = trees[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(trees), dim=axis_of(first, axis) if isinstance(axis, int)
                         else axis)
    if isinstance(first, Mapping):
        return {k: tree_cat([t[k] for t in trees], branch_axes(axis, k)) for k in first}
    return type(first)(tree_cat([t[i] for t in trees], branch_axes(axis, i))
                       for i in range(len(first)))


def branch_axes(axes: Axes, key: Any) -> Axes:
    """The axes of one branch of a tree (one int stands for every branch)."""
    return axes if isinstance(axes, int) else axes[key]


def batch_labels(data: Any, labels: Any) -> Any:
    """The targets of a batch: ``labels`` (``y``) when the data has separate targets, else
    the ``"labels"`` of a dict of inputs (a Hugging Face batch), else None."""
    if labels is not None:
        return labels
    return data.get("labels") if isinstance(data, Mapping) else None


def batch_length(tree: Any, axis: int = 0) -> int:
    """Number of samples (size of the batch ``axis``) of a tree of tensors."""
    leaves = tree_leaves(tree)
    if not leaves:
        raise TypeError(f"a batch must hold at least one tensor, got {type(tree).__name__}")
    first = leaves[0]
    return int(first.shape[axis_of(first, axis)]) if first.dim() else 1


@dataclass
class DataBatch:
    """One batch: inputs, labels, the bucket it belongs to and how many rows are padding.

    Args:
        data: a tensor, a tuple/list of tensors (passed as ``module(*data)``) or a dict
            (``module(**data)``); dim 0 is the batch.
        label: the targets (tensor or tuple of tensors), or None when predicting.
        bucket_key: hashable key of the executor group that runs this batch (None: default).
        pad: rows at the end of the batch that are padding and are ignored in outputs.
        index: optional original sample indices of the rows (used to restore predict order).
        global_rows: rows of this step over every rank, when the source knows it (under
            torch.distributed the loss weights need it; without it the manager all-reduces
            the count, one more collective per step).
        sample_weight: optional per-row loss weights (Keras's ``sample_weight``), shape
            ``(rows,)``.
        layout: the layout of the data and label tensors, as MXNet's ``DataDesc.layout``:
            they are split across devices on the axis of ``N`` (``"TNC"``: time-major, axis
            1); tensors with fewer dims split on axis 0. None: batch first.

    Raises:
        TypeError, ValueError: ``pad`` is not an int in ``[0, rows]``.

    Example:
        >>> b = DataBatch(torch.zeros(4, 3), torch.zeros(4, dtype=torch.long))
        >>> b.batch_size
        4
    """

    data: Inputs
    label: Any = None
    bucket_key: Hashable | None = None
    pad: int = 0
    index: torch.Tensor | None = None
    global_rows: int | None = None
    sample_weight: torch.Tensor | None = None
    layout: str | None = None

    @property
    def axis(self) -> int:
        """The batch axis of the data and labels (see ``layout``)."""
        return batch_axis(self.layout)

    def __post_init__(self) -> None:
        pad = self.pad
        if pad == 0 and type(pad) is int:  # the common case, checked in one comparison
            return
        if isinstance(pad, bool) or not isinstance(pad, int):
            raise TypeError(f"DataBatch.pad: got {pad!r} ({type(pad).__name__}); expected an "
                            f"int, the number of padding rows at the end of the batch")
        rows = self.batch_size
        if not 0 <= pad <= rows:
            raise ValueError(f"DataBatch.pad: got {pad}; expected an int in [0, {rows}] (the "
                             f"batch has {rows} rows). Fix: pad counts padding rows at the end.")

    @classmethod
    def of_rows(cls, data: Inputs, label: Any, global_rows: int | None,
                sample_weight: torch.Tensor | None = None) -> DataBatch:
        """A batch of a source's own rows, without padding, index, bucket or layout: what
        ``DataBatch(data, label, global_rows=..., sample_weight=...)`` makes, less its
        ``pad`` check (an in-memory source makes one every step)."""
        batch = cls.__new__(cls)
        batch.__dict__.update(data=data, label=label, bucket_key=None, pad=0, index=None,
                              global_rows=global_rows, sample_weight=sample_weight,
                              layout=None)
        return batch

    def check_rows(self) -> None:
        """Labels and sample weights must have one row per sample of the data.

        Raises:
            ValueError: naming both lengths.
        """
        rows, axis = self.batch_size, self.axis
        for name, tree in (("label", self.label), ("sample_weight", self.sample_weight)):
            for leaf in tree_leaves(tree):
                got = leaf.shape[axis_of(leaf, axis)] if leaf.dim() else "a scalar"
                if got != rows:
                    raise ValueError(
                        f"DataBatch.{name}: got {got} rows for data of {rows} rows; expected "
                        f"one {name} row per sample. Fix: pass data and {name} of the same "
                        f"length."
                    )

    @property
    def batch_size(self) -> int:
        return batch_length(self.data, self.axis)

    @property
    def provide_data(self) -> list[DataDesc]:
        return [
            DataDesc(n, tuple(t.shape), t.dtype, self.layout or "NT")
            for n, t in zip(tree_names(self.data, "data"), tree_leaves(self.data))
        ]

    @property
    def provide_label(self) -> list[DataDesc]:
        return [
            DataDesc(n, tuple(t.shape), t.dtype)
            for n, t in zip(tree_names(self.label, "label"), tree_leaves(self.label))
        ]


def checked_rows(batch: DataBatch) -> tuple[int, int]:
    """The batch's rows and batch axis, after ``DataBatch.check_rows`` (a batch of one data
    tensor and one label tensor is checked here without walking its trees: every step)."""
    layout, data, label = batch.layout, batch.data, batch.label
    axis = 0 if layout is None else batch_axis(layout)
    if data.__class__ is torch.Tensor and batch.sample_weight is None and data.dim() > axis:
        rows = data.shape[axis]
        if label is None:
            return rows, axis
        if label.__class__ is torch.Tensor and label.dim() and label.shape[
                axis if label.dim() > axis else 0] == rows:
            return rows, axis
    batch.check_rows()  # the message, or a batch of trees
    return batch.batch_size, axis
