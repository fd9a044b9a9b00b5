"""Helpers shared by the callbacks: monitored-value mode and improvement, argument checks."""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Any, Literal

# Substrings of log keys where higher is better ("auto" mode); "loss"/"error" win over them.
_MAX_HINTS = ("acc", "auc", "auroc", "precision", "recall", "f1", "fbeta", "iou", "jaccard",
              "dice", "r2", "specificity", "sensitivity")


def resolve_mode(monitor: str, mode: str, owner: str) -> str:
    """Return "min" or "max" for `monitor`, validating the `mode` argument of `owner`."""
    if not isinstance(monitor, str) or not monitor:
        raise TypeError(f"{owner}(monitor=...) got {monitor!r}; expected a log key such as "
                        "'val_loss' or 'val_multiclass_accuracy'.")
    if mode not in ("auto", "min", "max"):
        raise ValueError(f"{owner}(mode=...) got {mode!r}; expected 'auto', 'min' or 'max'. "
                         "Use 'min' for losses and errors, 'max' for accuracies and scores.")
    if mode != "auto":
        return mode
    name = monitor.lower()
    if "loss" in name or "error" in name:
        return "min"
    return "max" if any(hint in name for hint in _MAX_HINTS) else "min"


def is_improvement(current: float, best: float | None, mode: str, min_delta: float) -> bool:
    """Whether `current` beats `best` by more than `min_delta` (any value beats None)."""
    if best is None:
        return True
    if mode == "min":
        return current < best - min_delta
    return current > best + min_delta


def is_finite(value: Any) -> bool:
    """Whether `value` is a finite real number (NaN, inf and non-numbers are not)."""
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def monitor_value(logs: dict[str, float] | None, monitor: str, owner: str) -> float | None:
    """`logs[monitor]` as a float, or None with a warning naming the available keys."""
    logs = logs or {}
    value = logs.get(monitor)
    if value is None:
        warnings.warn(f"{owner} monitors {monitor!r}, which is not in the logs. Available keys: "
                      f"{', '.join(sorted(logs)) or '(none)'}. Pass monitor= one of them (and "
                      "validation_data to fit for 'val_' keys).", RuntimeWarning, stacklevel=3)
        return None
    return float(value)


def check_number(name: str, value: Any, owner: str, *, low: float | None = None,
                 high: float | None = None, low_open: bool = False,
                 high_open: bool = False) -> float:
    """Return `value` as a float after checking it is a real number within the given bounds."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and is_finite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        lo = "" if low is None else f"{'>' if low_open else '>='} {low}"
        hi = "" if high is None else f"{'<' if high_open else '<='} {high}"
        rng = " and ".join(r for r in (lo, hi) if r) or "finite"
        raise ValueError(f"{owner}({name}=...) got {value!r}; expected a real number {rng}.")
    return float(value)


def check_count(name: str, value: Any, owner: str, *, minimum: int = 1) -> int:
    """Return `value` after checking it is an int >= `minimum`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{owner}({name}=...) got {value!r}; expected an int >= {minimum}.")
    return int(value)


def check_save_freq(save_freq: Any, owner: str) -> Literal["epoch"] | int:
    """Return "epoch" or a positive int; anything else is a ValueError naming the fix."""
    if save_freq == "epoch":
        return "epoch"
    if isinstance(save_freq, numbers.Integral) and not isinstance(save_freq, bool) \
            and int(save_freq) > 0:
        return int(save_freq)
    raise ValueError(f"{owner}(save_freq=...) got {save_freq!r}; expected 'epoch' (save at "
                     "each epoch end) or a positive int N (save every N optimizer steps).")


def step_save_due(save_freq: str | int, step: int, last: int) -> bool:
    """Whether a ``save_freq=N`` save is due after optimizer step ``step``: once per step (with
    gradient accumulation several batches share one), never for ``save_freq="epoch"``."""
    return save_freq != "epoch" and step > 0 and step % int(save_freq) == 0 and step != last
