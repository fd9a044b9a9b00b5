"""How the progress output writes logs: short metric names, one number format, and lines
wrapped to the terminal's width."""

from __future__ import annotations

from functools import lru_cache

# torchmetrics' snake_case class names (and Keras's names) -> the short names shown.
SHORT_NAMES: dict[str, str] = {
    "accuracy": "acc", "precision": "prec", "recall": "rec", "f1_score": "f1",
    "fbeta_score": "fbeta", "auroc": "auc", "average_precision": "ap",
    "specificity": "spec", "jaccard_index": "iou", "matthews_corr_coef": "mcc",
    "cohen_kappa": "kappa", "calibration_error": "ece", "hamming_distance": "hamming",
    "exact_match": "exact", "mean_squared_error": "mse", "mean_absolute_error": "mae",
    "mean_absolute_percentage_error": "mape", "mean_squared_log_error": "msle",
    "r2_score": "r2", "perplexity": "ppl", "learning_rate": "lr",
}
TASK_PREFIXES = ("multiclass_", "multilabel_", "binary_")
MAX_NAME = 12  # longer names (after the above) become initials, or are cut to this length
SEPARATOR = " - "


def short_name(key: str) -> str:
    """The name a log key is shown under: `val_` kept, the torchmetrics task prefix dropped,
    well-known names shortened (`multiclass_accuracy` -> `acc`), other long names cut.

    Example:
        >>> [short_name(k) for k in ("val_multiclass_accuracy", "loss", "my_custom_metric")]
        ['val_acc', 'loss', 'mcm']
    """
    prefix, name = ("val_", key[4:]) if key.startswith("val_") else ("", key)
    for task in TASK_PREFIXES:
        if name.startswith(task) and len(name) > len(task):
            name = name[len(task):]
            break
    name = SHORT_NAMES.get(name, name)
    if len(name) > MAX_NAME:
        words = [w for w in name.split("_") if w]
        name = "".join(w[0] for w in words) if len(words) > 1 else name[:MAX_NAME]
    return prefix + name


@lru_cache(maxsize=64)
def display_names(keys: tuple[str, ...]) -> dict[str, str]:
    """`short_name` of every key, except keys whose short names would clash: those keep their
    full names, so two metrics are never shown under one name."""
    names = {k: short_name(k) for k in keys}
    while True:
        counts: dict[str, int] = {}
        for name in names.values():
            counts[name] = counts.get(name, 0) + 1
        clashing = [k for k, name in names.items() if counts[name] > 1 and name != k]
        if not clashing:
            return names
        for k in clashing:
            names[k] = k


def format_value(value: float) -> str:
    """Every number in one format: 4 significant digits (`0.1234`, `12.35`, `0.001`,
    `1.235e-05`)."""
    return f"{value:.4g}"


def log_items(logs: dict[str, float] | None) -> list[str]:
    """`["loss: 0.1234", "acc: 0.9612"]`, keys in the order the logs give them."""
    logs = logs or {}
    names = display_names(tuple(logs))
    return [f"{names[k]}: {format_value(float(v))}" for k, v in logs.items()]


def take_fitting(items: list[str], width: int) -> int:
    """How many leading `items`, joined by the separator, fit in `width` characters."""
    used = -len(SEPARATOR)
    for i, item in enumerate(items):
        used += len(SEPARATOR) + len(item)
        if used > width:
            return i
    return len(items)


def wrap(items: list[str], width: int, indent: str = "    ", first: str = "") -> list[str]:
    """`items` joined by the separator into lines of at most `width` characters, breaking only
    between items; the first line starts with `first`, the others with `indent` (an item
    longer than a line gets a line of its own)."""
    lines: list[str] = []
    rest = list(items)
    while rest:
        lead = indent if lines else first
        n = max(1, take_fitting(rest, width - len(lead)))
        lines.append(lead + SEPARATOR.join(rest[:n]))
        rest = rest[n:]
    return lines
