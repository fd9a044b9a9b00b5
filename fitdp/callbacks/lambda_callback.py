"""`LambdaCallback`: a callback made of plain functions, Keras style."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fitdp.callbacks.base import HOOKS, Callback
from fitdp.checks import fail

_NAMES = HOOKS + ("on_batch_begin", "on_batch_end")


class LambdaCallback(Callback):
    """Builds a callback from functions with the hooks' signatures.

    `on_epoch_begin/end` take `(epoch, logs)`, `on_train_begin/end` and the other `*_begin/end`
    take `(logs)`, batch hooks take `(batch, logs)`. Any hook of `Callback` may be passed by
    name; hooks not given do nothing (and cost nothing: the dispatcher skips them).

    Args:
        on_epoch_begin, on_epoch_end, on_train_begin, on_train_end, on_train_batch_begin,
        on_train_batch_end: functions called at those points, or None.
        **hooks: any other hook by name (`on_test_end=...`, `on_predict_batch_end=...`).

    Raises:
        TypeError: a keyword is not a hook name, or a value is not callable.

    Example:
        >>> seen = []
        >>> cb = LambdaCallback(on_epoch_end=lambda epoch, logs: seen.append(logs["loss"]))
        >>> cb.on_epoch_end(0, {"loss": 0.25}); seen
        [0.25]
    """

    def __init__(self, on_epoch_begin: Callable[..., Any] | None = None,
                 on_epoch_end: Callable[..., Any] | None = None,
                 on_train_begin: Callable[..., Any] | None = None,
                 on_train_end: Callable[..., Any] | None = None,
                 on_train_batch_begin: Callable[..., Any] | None = None,
                 on_train_batch_end: Callable[..., Any] | None = None,
                 **hooks: Callable[..., Any] | None) -> None:
        super().__init__()
        hooks.update(on_epoch_begin=on_epoch_begin, on_epoch_end=on_epoch_end,
                     on_train_begin=on_train_begin, on_train_end=on_train_end,
                     on_train_batch_begin=on_train_batch_begin,
                     on_train_batch_end=on_train_batch_end)
        for name, fn in hooks.items():
            if name not in _NAMES:
                fail(f"LambdaCallback({name}=...)", "an unknown keyword", "hook names: "
                     + ", ".join(_NAMES), error=TypeError, described=True)
            if fn is None:
                continue
            if not callable(fn):
                fail(f"LambdaCallback({name}=...)", fn,
                     "a function with that hook's signature, or None", error=TypeError)
            # An instance attribute shadows the no-op method; the dispatcher sees it as set.
            setattr(self, name, fn)
