"""Checks and conversions of variable-length sequences and their labels (``BucketIterator``'s
arguments), each bad input a TypeError/ValueError naming it."""

from __future__ import annotations

from typing import Any

import torch


def to_tensor(name: str, value: Any, expected: str) -> torch.Tensor:
    """``value`` as a CPU tensor, else a TypeError naming ``name``."""
    try:
        return value.detach().cpu() if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"{name}: received {type(value).__name__} that is not numeric ({e}); "
                        f"expected {expected}.") from None


def as_sequences(sequences: Any) -> list[torch.Tensor]:
    """Convert and check every sequence: a non-empty 1-D numeric tensor on the CPU."""
    if isinstance(sequences, (str, bytes)) or not hasattr(sequences, "__len__"):
        raise TypeError(f"sequences: received {type(sequences).__name__}; expected a list.")
    if len(sequences) == 0:
        raise ValueError("sequences: received an empty list; expected at least one sequence.")
    out = []
    for i, s in enumerate(sequences):
        t = to_tensor(f"sequences[{i}]", s, "a 1-D tensor, list of ints or numpy array")
        if t.dim() != 1 or len(t) == 0:
            got, fix = ("an empty sequence", "drop empty sequences first") if t.dim() == 1 else (
                f"shape {tuple(t.shape)}", "flatten it")
            raise ValueError(f"sequences[{i}]: received {got}; expected a non-empty 1-D "
                             f"sequence. Fix: {fix}.")
        out.append(t)
    return out


def as_labels(labels: Any, lengths: torch.Tensor) -> tuple[torch.Tensor | None, bool]:
    """Labels as one CPU tensor (per token: concatenated; else dim 0 is the sample), and
    whether they are per token."""
    count, sizes = len(lengths), lengths.tolist()
    if not isinstance(labels, (list, tuple, str, bytes)) and getattr(labels, "ndim", None) is None \
            and hasattr(labels, "__len__"):
        labels = list(labels)  # a column of rows (a Hugging Face dataset's ds["labels"])
    if isinstance(labels, (list, tuple)) and len(labels) == count and all(
        isinstance(x, (list, tuple)) or getattr(x, "ndim", 0) >= 1 for x in labels
    ):  # a list of sequences: per token, or per sample if all alike (e.g. one-hot rows)
        rows = [to_tensor(f"labels[{i}]", x, "numbers") for i, x in enumerate(labels)]
        bad = [i for i, r in enumerate(rows) if r.shape != (sizes[i],)]
        if bad and len({r.shape for r in rows}) > 1:
            i = bad[0]
            raise ValueError(f"labels[{i}]: received shape {tuple(rows[i].shape)} for sequences"
                             f"[{i}] of length {sizes[i]}; expected per-token labels of shape "
                             f"({sizes[i]},). Fix: one label per token (a language model's: "
                             "shift by one, end with label_pad).")
        return (torch.stack(rows), False) if bad else (torch.cat(rows), True)
    if labels is None:
        return None, False
    t = to_tensor("labels", labels, "one label per sequence, or None")
    if t.dim() == 0 or t.shape[0] != count:
        got = "a scalar" if t.dim() == 0 else f"{t.shape[0]} labels"
        raise ValueError(f"labels: received {got} for {count} sequences; expected one label "
                         "(or label sequence) per sequence. Fix: pass labels in the same order "
                         "and number as sequences.")
    return t, False


def check_pad(name: str, value: Any, what: str, dtype: torch.dtype) -> int | float:
    """``value`` as a pad of ``dtype`` (torch.full would silently truncate 0.5 to 0)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            dtype.is_floating_point or float(value).is_integer()):
        raise TypeError(f"{name}: received {value!r} for {what} of dtype {dtype}; expected a "
                        f"number of that dtype. Fix: pass e.g. {name}="
                        f"{-100 if what == 'labels' else 0}.")
    return value if dtype.is_floating_point else int(value)

