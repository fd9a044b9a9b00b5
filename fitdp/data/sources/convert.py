"""Turning what a user passes (numpy arrays, tensors, nested tuples/dicts) into tensors."""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from fitdp.checks import check_number, fail
from fitdp.data.batch import batch_length, tree_map

# numpy dtype kinds torch can hold: bool, signed and unsigned ints, floats, complex (not
# objects, strings, bytes, structured records or datetimes)
_NUMERIC_KINDS = "biufc"


def as_tensors(x: Any, name: str) -> Any:
    """numpy arrays -> tensors (float64 -> float32, as Keras does); validate the nesting.

    A numpy array with negative strides (a reversed view) is copied; the others share
    memory with their tensor.

    Raises:
        TypeError: naming ``name``, for anything but tensors, numeric arrays and
            tuples/lists/dicts of them (an array of objects or strings included).
    """
    if isinstance(x, np.ndarray):
        if x.dtype.kind not in _NUMERIC_KINDS:
            fail(name, f"a numpy array of dtype {x.dtype} (shape {x.shape})",
                 "numbers: a bool, int, float or complex dtype",
                 f"convert it first, e.g. {name}.astype(np.float32), or encode strings as "
                 "class indices", error=TypeError, described=True)
        if any(s < 0 for s in x.strides):  # a reversed view (a[::-1]): torch cannot share it
            x = np.ascontiguousarray(x)
        t = torch.from_numpy(x)
        return t.float() if t.dtype == torch.float64 else t
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, Mapping):
        return {k: as_tensors(v, f"{name}[{k!r}]") for k, v in x.items()}
    if isinstance(x, (tuple, list)) and x and all(
        isinstance(v, (torch.Tensor, np.ndarray, Mapping, tuple, list)) for v in x
    ):
        return tuple(as_tensors(v, f"{name}[{i}]") for i, v in enumerate(x))
    fail(name, x, "a tensor, a numpy array, or a tuple/list/dict of them", error=TypeError)


def read_tensors(x: Any, y: Any, w: Any, *, has_labels: bool, labels_optional: bool,
                 name: str) -> tuple[Any, Any, torch.Tensor | None]:
    """In-memory ``x``, ``y`` and ``sample_weight`` as tensors, converted and checked once
    (``make_source``'s arguments): an ``(x, y[, sample_weight])`` tuple unpacked, numpy
    converted, rows counted, every float scanned for NaN and infinity (fit and evaluate).

    Raises:
        ValueError: no samples, lengths that differ, missing targets, a NaN or an infinity.
        TypeError: anything but tensors, numeric arrays and tuples/lists/dicts of them.
    """
    if has_labels and y is None and isinstance(x, tuple) and len(x) in (2, 3):  # (x, y[, w])
        x, y, w = (*x, w) if len(x) == 2 else x
    x = as_tensors(x, name)
    n = batch_length(x)
    if n == 0:
        fail(name, "0 samples", "at least one", described=True)
    check_rows(x, name, n, first=f"{name}'s first input")
    if has_labels:  # fit and evaluate (a NaN there trains or scores silently to NaN)
        check_finite(x, name)
    if y is not None:
        y = as_tensors(y, "y")
        check_rows(y, "y", n, first=name)
        check_finite(y, "y" if name == "x" else f"{name} targets")
    elif has_labels and not labels_optional:
        fail("y", None, f"targets for {name}", "pass y=... or x=(inputs, targets)",
             error=ValueError)
    if w is not None:
        w = _weights(as_tensors(w, "sample_weight"), "sample_weight")
        check_rows(w, "sample_weight", n, first=name)
        check_finite(w, "sample_weight")
    return x, y, w


def _weights(w: Any, name: str) -> torch.Tensor:
    if not isinstance(w, torch.Tensor) or w.dim() != 1 or not w.is_floating_point():
        fail(name, f"{type(w).__name__} of shape {tuple(getattr(w, 'shape', ()))}",
             "a 1-D float tensor or array, one weight per sample", described=True)
    return w


def leaves_with_names(tree: Any, name: str) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor of a tree, named like ``x[0]`` or ``x['ids']``."""
    if isinstance(tree, torch.Tensor):
        return [(name, tree)]
    if tree is None:
        return []
    items = tree.items() if isinstance(tree, Mapping) else enumerate(tree)
    return [p for k, v in items for p in leaves_with_names(v, f"{name}[{k!r}]")]


def check_rows(tree: Any, name: str, rows: int, first: str = "x") -> None:
    """Every tensor of ``tree`` has ``rows`` rows, else a ValueError naming both lengths."""
    for leaf_name, leaf in leaves_with_names(tree, name):
        got = leaf.shape[0] if leaf.dim() else 0
        if got != rows:
            fail(leaf_name, f"{got} rows", f"{rows} rows, one per sample of {first}",
                 f"pass {first} and {name} of the same length", described=True)


# Tensors found finite, by id: (a weak reference, the version then). A tensor passed to
# one call after another (an epoch per ``fit``, as in a tuning loop) is scanned once while
# torch sees no write to it: a sum of 4M values is 0.6-1.9 ms, 30-90 us a step of a 20-step
# fit (measured, MLP 784-512-512-10 on 5,120 rows).
_FINITE: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}


def _seen_finite(t: torch.Tensor) -> bool:
    """Whether ``t`` was found finite and torch has seen no write to it since (an in-place
    op bumps its version; a write through numpy memory or ``.data`` does not)."""
    seen = _FINITE.get(id(t))
    return seen is not None and seen[0]() is t and seen[1] == t._version


def _remember_finite(t: torch.Tensor) -> None:
    key = id(t)

    def forget(ref: weakref.ref[torch.Tensor]) -> None:  # t is gone: its id may come again
        if _FINITE.get(key, (None,))[0] is ref:
            del _FINITE[key]

    _FINITE[key] = (weakref.ref(t, forget), t._version)


def check_finite(tree: Any, name: str) -> None:
    """Every float in ``tree`` is finite, else a ValueError naming the tensor and its first
    row holding a NaN or an infinity (one would turn every weight to NaN without a word).

    One sum per tensor (a NaN or infinity makes the sum one, so a finite sum clears it), and
    only once while torch sees no write to the tensor (``_FINITE``): 36 ms per 10M float32
    values on this project's 2-core CPU, against 330 ms for ``isfinite``.
    Only a sum that is not finite (a bad value, or finite values that overflow it) pays for
    the search of the row, in chunks of about 16M values (``isfinite`` makes a bool copy).
    """
    for leaf_name, leaf in leaves_with_names(tree, name):
        if not (leaf.is_floating_point() or leaf.is_complex()) or _seen_finite(leaf):
            continue
        if bool(torch.isfinite(leaf.sum()).all()):
            _remember_finite(leaf)
            continue
        flat = leaf.reshape(1, 1) if leaf.dim() == 0 else leaf
        width = flat[:1].numel()  # values per row
        step = max(1, (1 << 24) // max(1, width))
        for start in range(0, flat.shape[0], step):
            chunk = flat[start:start + step]
            bad = ~torch.isfinite(chunk.reshape(chunk.shape[0], width)).all(1)
            if bool(bad.any()):
                row = start + int(bad.nonzero()[0, 0])
                values = flat[row].reshape(-1)
                first = values[~torch.isfinite(values)][0]
                fail(leaf_name, f"{first.item()} in row {row}",
                     "finite numbers (no NaN or infinity)",
                     f"replace or drop those rows (e.g. torch.nan_to_num({leaf_name})); a "
                     f"model that handles NaN itself can take its data in batches (a "
                     f"DataLoader, a Dataset, DataBatch objects), which are not scanned",
                     described=True)


def split_validation(fraction: Any, *trees: Any) -> tuple[list[Any], list[Any]]:
    """Keras's ``validation_split``: the first ``floor(n * (1 - fraction))`` samples train,
    the rest validate, taken before any shuffling (so every tree is cut at the same row).

    Returns:
        ``(train trees, validation trees)``, None trees kept as None.

    Raises:
        TypeError, ValueError: ``fraction`` is not a number in (0, 1), or a split is empty.
    """
    f = check_number("validation_split", fraction, low=0, high=1, low_open=True,
                     high_open=True)
    n = batch_length(trees[0])
    # Keras 3 (``train_validation_split``): split_at = floor(num_samples * (1 - split)).
    cut = int(math.floor(n * (1.0 - f)))
    if cut <= 0 or cut >= n:
        fail("validation_split", fraction, f"a fraction that leaves at least one of the {n} "
             f"samples on each side (it gives {cut} to train, {n - cut} to validate)")
    return list(tree_map(lambda t: t[:cut], trees)), list(tree_map(lambda t: t[cut:], trees))
