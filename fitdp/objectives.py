"""Loss functions: the names ``compile(loss=...)`` accepts, and target checks made up front."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

LOSSES: dict[str, Callable[[Any, Any], torch.Tensor]] = {
    "cross_entropy": F.cross_entropy,
    "mse": F.mse_loss,
    "l1": F.l1_loss,
    "bce_with_logits": F.binary_cross_entropy_with_logits,
}


def resolve_loss(loss: str | nn.Module | Callable[[Any, Any], torch.Tensor]) -> Callable[..., Any]:
    """Turn ``compile(loss=...)`` into ``callable(outputs, targets) -> scalar``.

    Raises:
        ValueError: an unknown name.
        TypeError: something that is not a name, a module or a callable.
    """
    if isinstance(loss, str):
        if loss not in LOSSES:
            raise ValueError(
                f"loss: unknown name {loss!r}; expected one of {sorted(LOSSES)}, an nn.Module "
                f"or a callable(outputs, targets) -> scalar tensor"
            )
        return LOSSES[loss]
    if callable(loss):
        return loss
    raise TypeError(
        f"loss: got {type(loss).__name__}; expected a name such as 'cross_entropy', an "
        f"nn.Module or a callable(outputs, targets) -> scalar tensor"
    )


def check_targets(loss: Any, targets: Any) -> None:
    """Catch target dtypes that a named loss cannot use, before any weight changes.

    Raises:
        ValueError: float targets with ``cross_entropy``, integer targets with a regression
            or binary loss.
    """
    if not isinstance(loss, str) or not isinstance(targets, torch.Tensor):
        return
    if loss == "cross_entropy" and targets.is_floating_point():
        raise ValueError(
            f"loss='cross_entropy': got {targets.dtype} targets of shape "
            f"{tuple(targets.shape)}; expected integer class indices (torch.long). Fix: "
            f"pass y.long(), or for soft labels compile with loss=torch.nn.CrossEntropyLoss()."
        )
    if loss in ("mse", "l1", "bce_with_logits") and not targets.is_floating_point():
        raise ValueError(
            f"loss={loss!r}: got {targets.dtype} targets; expected floating-point targets. "
            f"Fix: pass y.float()."
        )
