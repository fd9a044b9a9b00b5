"""Variable-length data: predictions of several lengths, losses that average over tokens,
metrics on time-major outputs.

A foundation (it imports only ``fitdp.data.batch``): the call layer (``loop.assemble``), the
objectives and the metrics all use it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.nn import functional as F

from fitdp.data.batch import Axes, axis_of, branch_axes, tree_map, tree_map_axes

PAD_VALUE = 0.0  # predict's default pad for outputs shorter than the longest (as pad_sequence)


def pad_cat(trees: list[Any], axis: Axes = 0, pad_value: float = PAD_VALUE) -> Any:
    """Concatenate same-structure trees along the batch ``axis`` (or per-tensor axes), every
    other dim padded at its end with ``pad_value`` to the largest size (a tagger's batches of
    several lengths).

    Example:
        >>> pad_cat([torch.ones(1, 2), torch.ones(1, 3)], pad_value=-1.0)
        tensor([[ 1.,  1., -1.],
                [ 1.,  1.,  1.]])
    """
    first = trees[0]
    if isinstance(first, torch.Tensor):
        dim = axis_of(first, axis) if isinstance(axis, int) else axis
        sizes = [max(t.shape[d] for t in trees) for d in range(first.dim())]
        parts = [_pad_to(t, sizes, dim, pad_value) for t in trees]
        return torch.cat(parts, dim=dim)
    if isinstance(first, Mapping):
        return {k: pad_cat([t[k] for t in trees], branch_axes(axis, k), pad_value) for k in first}
    return type(first)(pad_cat([t[i] for t in trees], branch_axes(axis, i), pad_value)
                       for i in range(len(first)))


def _pad_to(t: torch.Tensor, sizes: list[int], batch_dim: int, value: float) -> torch.Tensor:
    """``t`` padded at the end of every dim but ``batch_dim`` to ``sizes`` (t itself if it fits)."""
    if all(t.shape[d] == s or d == batch_dim for d, s in enumerate(sizes)):
        return t
    widths: list[int] = []
    for d in reversed(range(t.dim())):  # F.pad lists the last dim first
        widths += [0, 0 if d == batch_dim else sizes[d] - t.shape[d]]
    return F.pad(t, widths, value=value)


def split_samples(tree: Any, axis: Axes = 0) -> list[Any]:
    """One tree per sample (the batch ``axis`` removed), in batch order.

    Example:
        >>> [tuple(s.shape) for s in split_samples(torch.zeros(5, 2, 3), axis=1)]
        [(5, 3), (5, 3)]
    """
    sizes: list[int] = []
    tree_map_axes(lambda t, a: sizes.append(int(t.shape[a])), tree, axis)
    rows = sizes[0] if sizes else 0

    def sample(i: int) -> Any:
        return tree_map_axes(lambda t, a: t.select(a, i), tree, axis)

    return [sample(i) for i in range(rows)]


def reorder(tree: Any, order: torch.Tensor, axis: Axes = 0) -> Any:
    """Every tensor of ``tree`` with its rows along the batch ``axis`` (or per-tensor axes)
    taken in ``order``."""
    return tree_map_axes(lambda t, a: t.index_select(a, order), tree, axis)


class TokenMean:
    """Declares that a loss averages over tokens, not rows: the targets that are not
    ``ignore_index`` (MXNet's ``invalid_label``, torch's -100).

    On several devices a slice's loss is weighed by the tokens it averages (not its rows),
    so the update and the logged loss equal one device on the whole batch. Any callable with
    a ``counts(targets) -> Tensor`` method declares its denominator the same way.

    Args:
        fn: ``(outputs, targets) -> scalar``, the mean over the non-ignored targets, e.g.
            ``lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten())`` for time-major
            ``(T, N, C)`` logits.
        ignore_index: the target value ``fn`` skips.

    Example:
        >>> loss = TokenMean(lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten()))
        >>> int(loss.counts(torch.tensor([[1, -100], [2, 0]])))
        3
    """

    def __init__(self, fn: Callable[[Any, Any], torch.Tensor], ignore_index: int = -100
                 ) -> None:
        if not callable(fn):
            raise TypeError(f"fn: got {type(fn).__name__}; expected a callable(outputs, "
                            f"targets) -> scalar tensor (the mean over the kept tokens)")
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise TypeError(f"ignore_index: got {ignore_index!r}; expected an int such as -100"
                            f" (the label_pad of fitdp.BucketIterator)")
        self.fn, self.ignore_index = fn, ignore_index

    def __call__(self, outputs: Any, targets: Any) -> torch.Tensor:
        return self.fn(outputs, targets)

    def counts(self, targets: Any) -> torch.Tensor:
        """The targets the mean divides by (one op on the targets' device)."""
        return (targets != self.ignore_index).sum()

    def __repr__(self) -> str:
        return f"TokenMean({self.fn!r}, ignore_index={self.ignore_index})"


def batch_first(outputs: Any, labels: Any, axis: int, out_axes: Axes = None
                ) -> tuple[Any, Any]:
    """Outputs and labels of time-major data (batch ``axis`` > 0) as torchmetrics takes them:
    the batch axis first, and per-token class scores ``(T, N, C)`` (a class axis after the
    labels' dims) as ``(N, C, T)``. ``out_axes``: each output's batch axis
    (``fitdp.data.batch.output_axes``: a classifier's ``(N, C)`` is batch-first already);
    None: ``axis``. Batch-first data (``axis`` 0) is returned as it is.

    Example:
        >>> o, t = batch_first(torch.zeros(7, 2, 5), torch.zeros(7, 2), axis=1)
        >>> tuple(o.shape), tuple(t.shape)
        ((2, 5, 7), (2, 7))
    """
    if axis == 0:
        return outputs, labels
    lab = tree_map(lambda t: t.movedim(axis_of(t, axis), 0), labels)
    out = tree_map_axes(lambda t, a: t.movedim(a, 0), outputs,
                        axis if out_axes is None else out_axes)
    if (isinstance(out, torch.Tensor) and isinstance(lab, torch.Tensor)
            and out.dim() == lab.dim() + 1 and lab.dim() >= 2
            and out.shape[:-1] == lab.shape):
        out = out.movedim(-1, 1)  # the class axis where torchmetrics looks for it
    return out, lab


def check_pad_args(pad_value: Any, ragged: Any) -> None:
    """``predict``'s ``pad_value`` (any real number, NaN included, or None: the default of
    the outputs' kind) and ``ragged`` (a bool)."""
    if pad_value is not None and (
            isinstance(pad_value, bool) or not isinstance(pad_value, (int, float))):
        raise TypeError(f"pad_value: got {pad_value!r}; expected a number (the value written "
                        f"after outputs shorter than the longest, e.g. 0.0 or float('nan')), "
                        f"or None")
    if not isinstance(ragged, bool):
        raise TypeError(f"ragged: got {ragged!r}; expected True (a list of per-sample outputs)"
                        f" or False (one tensor padded with pad_value)")
