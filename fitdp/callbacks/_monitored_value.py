"""Monitored-value helpers for the callbacks that watch one log key (`monitor=`): which
direction is better, whether a value improved, and reading it from the logs."""

from __future__ import annotations

import math
import warnings
from typing import Any

from fitdp.callbacks._log_format import display_names
from fitdp.checks import check_choice, fail

# Substrings of log keys where higher is better ("auto" mode); "loss"/"error" win over them.
_MAX_HINTS = ("acc", "auc", "auroc", "precision", "recall", "f1", "fbeta", "iou", "jaccard",
              "dice", "r2", "specificity", "sensitivity")


def resolve_mode(monitor: Any, mode: Any, owner: str) -> str:
    """Return "min" or "max" for `monitor`, validating the `monitor` and `mode` of `owner`."""
    if not isinstance(monitor, str) or not monitor:
        fail(f"{owner}(monitor=...)", monitor, "a log key such as 'val_loss' or 'val_acc'",
             error=TypeError)
    check_choice(f"{owner}(mode=...)", mode, ("auto", "min", "max"),
                 "use 'min' for losses and errors, 'max' for accuracies and scores")
    if mode != "auto":
        return str(mode)
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


def monitor_key(logs: dict[str, float], monitor: str) -> str:
    """The log key `monitor` names: itself, or the key the progress output shows under that
    name (`val_acc` for `val_multiclass_accuracy`), so what is on screen can be monitored."""
    if monitor in logs:
        return monitor
    shown = [k for k, name in display_names(tuple(logs)).items() if name == monitor]
    return shown[0] if len(shown) == 1 else monitor


def monitor_value(logs: dict[str, float] | None, monitor: str, owner: str) -> float | None:
    """`logs[monitor]` (or of the key shown as `monitor`) as a float, or None with a
    UserWarning naming the available keys."""
    logs = logs or {}
    value = logs.get(monitor_key(logs, monitor))
    if value is None:
        warnings.warn(f"{owner} monitors {monitor!r}, which is not in the logs. Available keys: "
                      f"{', '.join(sorted(logs)) or '(none)'}. Pass monitor= one of them (and "
                      "validation_data to fit for 'val_' keys).", UserWarning, stacklevel=3)
        return None
    return float(value)
