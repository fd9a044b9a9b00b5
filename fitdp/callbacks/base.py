"""`Callback`, the hook interface, and `CallbackList`, its one dispatcher."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

# Every hook a model may dispatch, with Keras names. `on_batch_begin/end` are Keras aliases that
# `on_train_batch_begin/end` forward to, so they are not dispatched on their own.
HOOKS: tuple[str, ...] = (
    "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end",
    "on_train_batch_begin", "on_train_batch_end",
    "on_test_begin", "on_test_end", "on_test_batch_begin", "on_test_batch_end",
    "on_predict_begin", "on_predict_end", "on_predict_batch_begin", "on_predict_batch_end",
)
_ALIASES = {"on_train_batch_begin": "on_batch_begin", "on_train_batch_end": "on_batch_end"}


class Callback:
    """Base class of every callback: override the hooks you need, Keras style.

    `self.model` is the `fitdp.Model` being trained (set by `set_model`), `self.params` a dict
    with `epochs`, `steps`, `verbose` and `batch_size`. Every `logs` is a `dict[str, float]`;
    batch logs may be stale between the model's sync points unless `sync_every_batch` is True.

    Example:
        >>> class PrintLoss(Callback):
        ...     def on_epoch_end(self, epoch, logs=None):
        ...         print(epoch, logs["loss"])
        >>> PrintLoss().on_epoch_end(0, {"loss": 0.5})
        0 0.5
    """

    # True makes the model read the loss on the host every batch (one device sync per batch).
    sync_every_batch: bool = False
    model: Any = None  # class default: subclasses that skip super().__init__() still work

    def __init__(self) -> None:
        self.model: Any = None
        self.params: dict[str, Any] = {}

    def set_model(self, model: Any) -> None:
        """Attach the model the hooks steer (through `model.stop_training` and friends)."""
        self.model = model

    def set_params(self, params: dict[str, Any]) -> None:
        """Receive the run's parameters: `epochs`, `steps`, `verbose`, `batch_size`."""
        self.params = dict(params)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to resume this callback; empty for stateless ones."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (stateless callbacks ignore it)."""

    def _is_main_process(self) -> bool:
        """False on non-zero ranks: such a callback must not write files, print or log."""
        return self.model is None or bool(getattr(self.model, "is_main_process", True))

    def on_train_begin(self, logs: dict[str, float] | None = None) -> None:
        """Called once at the start of `fit`."""

    def on_train_end(self, logs: dict[str, float] | None = None) -> None:
        """Called once at the end of a successful `fit`."""

    def on_epoch_begin(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        """Called at the start of each epoch (`epoch` is 0-based)."""

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        """Called at the end of each epoch with train and `val_` logs."""

    def on_batch_begin(self, batch: int, logs: dict[str, float] | None = None) -> None:
        """Keras alias of `on_train_batch_begin`."""

    def on_batch_end(self, batch: int, logs: dict[str, float] | None = None) -> None:
        """Keras alias of `on_train_batch_end`."""

    def on_train_batch_begin(self, batch: int, logs: dict[str, float] | None = None) -> None:
        """Called before each training batch (`batch` is the 0-based index in the epoch)."""
        self.on_batch_begin(batch, logs)

    def on_train_batch_end(self, batch: int, logs: dict[str, float] | None = None) -> None:
        """Called after each training batch with the (possibly stale) running logs."""
        self.on_batch_end(batch, logs)

    def on_test_begin(self, logs: dict[str, float] | None = None) -> None:
        """Called at the start of `evaluate` and of each validation pass."""

    def on_test_end(self, logs: dict[str, float] | None = None) -> None:
        """Called at the end of `evaluate` and of each validation pass."""

    def on_test_batch_begin(self, batch: int, logs: dict[str, float] | None = None) -> None:
        """Called before each evaluation batch."""

    def on_test_batch_end(self, batch: int, logs: dict[str, float] | None = None) -> None:
        """Called after each evaluation batch."""

    def on_predict_begin(self, logs: dict[str, float] | None = None) -> None:
        """Called at the start of `predict`."""

    def on_predict_end(self, logs: dict[str, float] | None = None) -> None:
        """Called at the end of `predict`."""

    def on_predict_batch_begin(self, batch: int, logs: dict[str, float] | None = None) -> None:
        """Called before each prediction batch."""

    def on_predict_batch_end(self, batch: int, logs: dict[str, float] | None = None) -> None:
        """Called after each prediction batch."""


def _overrides(cb: Any, hook: str) -> bool:
    """Whether `cb` does something in `hook` (subclass method, instance attribute or duck type)."""
    names = (hook, _ALIASES[hook]) if hook in _ALIASES else (hook,)
    for name in names:
        if name in getattr(cb, "__dict__", {}) and callable(cb.__dict__[name]):
            return True  # set on the instance, e.g. by LambdaCallback
        impl = getattr(type(cb), name, None)
        if impl is None:
            if callable(getattr(cb, name, None)):
                return True  # duck-typed object or MagicMock(spec=Callback)
        elif impl is not getattr(Callback, name):
            return True
    return False


class CallbackList:
    """The model's view of its callbacks: one `call(hook_name, *args)` dispatches to all.

    Only callbacks that override a hook are called for it (precomputed), so a batch hook nobody
    overrides costs one dict lookup. User callbacks keep their order; a `History` goes before
    them (so a checkpoint saved in a user's `on_epoch_end` holds that epoch) and a
    `ProgressBar` last, unless the user passed their own.

    Args:
        callbacks: `Callback` objects (or one), in the order their hooks run.
        model: the model to attach to every callback (`set_model`).
        add_history: append a `History` when none is given.
        add_progbar: append a `ProgressBar(verbose=verbose)` when none is given and
            `verbose != 0`.
        verbose: 0, 1, 2 or "auto", for the added progress bar.
        params: run parameters passed to every callback's `set_params`.

    Raises:
        TypeError: an entry is not a callback (for example the class instead of an instance).

    Example:
        >>> cbs = CallbackList([], add_history=True)
        >>> cbs.call("on_train_begin", {})
        >>> cbs.call("on_epoch_end", 0, {"loss": 0.5})
        >>> cbs.history.history
        {'loss': [0.5]}
    """

    def __init__(self, callbacks: Callback | Iterable[Callback] | None = None, *,
                 model: Any = None, add_history: bool = False, add_progbar: bool = False,
                 verbose: int | str = 1, params: dict[str, Any] | None = None) -> None:
        from fitdp.callbacks.history import History  # the submodules import this one
        from fitdp.callbacks.progress import ProgressBar

        items: Iterable[Any]
        if callbacks is None:
            items = []
        elif isinstance(callbacks, Callback) or _looks_like_callback(callbacks):
            items = [callbacks]
        else:
            items = callbacks
        self.callbacks: list[Any] = list(items)
        for i, cb in enumerate(self.callbacks):
            _check_callback(i, cb)
        self._history = next((cb for cb in self.callbacks if isinstance(cb, History)), None)
        if self._history is None and add_history:
            self._history = History()
            # First, so a checkpoint written by a later on_epoch_end includes this epoch.
            self.callbacks.insert(0, self._history)
        has_bar = any(isinstance(cb, ProgressBar) for cb in self.callbacks)
        if add_progbar and not has_bar and verbose != 0:
            self.callbacks.append(ProgressBar(verbose=verbose))
        self._rebuild()
        if model is not None:
            self.set_model(model)
        if params is not None:
            self.set_params(params)

    def _rebuild(self) -> None:
        """Precompute, per hook, the bound methods of the callbacks that override it."""
        self._hooks: dict[str, list[Callable[..., Any]]] = {
            hook: [getattr(cb, hook) for cb in self.callbacks if _overrides(cb, hook)]
            for hook in HOOKS
        }
        self._sync = any(getattr(cb, "sync_every_batch", False) is True for cb in self.callbacks)

    def call(self, hook_name: str, *args: Any) -> None:
        """Run `hook_name(*args)` on every callback that overrides it, in order.

        Raises:
            ValueError: `hook_name` is not one of the hook names in `HOOKS`.
        """
        try:
            fns = self._hooks[hook_name]
        except KeyError:
            raise ValueError(f"CallbackList.call got hook_name={hook_name!r}; expected one of "
                             f"{', '.join(HOOKS)}.") from None
        for fn in fns:
            fn(*args)

    def append(self, callback: Callback) -> None:
        """Add a callback after the others (it gets the model and params already set)."""
        _check_callback(len(self.callbacks), callback)
        self.callbacks.append(callback)
        if getattr(self, "_model", None) is not None:
            callback.set_model(self._model)
        if getattr(self, "_params", None) is not None:
            callback.set_params(self._params)
        self._rebuild()

    def set_model(self, model: Any) -> None:
        """Attach `model` to every callback."""
        self._model = model
        for cb in self.callbacks:
            if hasattr(cb, "set_model"):
                cb.set_model(model)

    def set_params(self, params: dict[str, Any]) -> None:
        """Pass the run parameters (`epochs`, `steps`, `verbose`, `batch_size`) to each callback."""
        self._params = dict(params)
        for cb in self.callbacks:
            if hasattr(cb, "set_params"):
                cb.set_params(self._params)

    def state_dict(self) -> dict[str, Any]:
        """TEMPORARY (replaced by the callbacks branch): states keyed by class and position."""
        states = {f"{type(cb).__name__}:{i}": cb.state_dict() for i, cb in
                  enumerate(self.callbacks) if callable(getattr(cb, "state_dict", None))}
        return {k: v for k, v in states.items() if isinstance(v, dict) and v}

    def load_state_dict(self, states: dict[str, Any]) -> None:
        for i, cb in enumerate(self.callbacks):
            key = f"{type(cb).__name__}:{i}"
            if key in states and hasattr(cb, "load_state_dict"):
                cb.load_state_dict(states[key])

    @property
    def sync_every_batch(self) -> bool:
        """True when some callback needs the exact loss after every batch."""
        return self._sync

    @property
    def history(self) -> Any:
        """The `History` callback of this list, or None when there is none."""
        return self._history

    def __iter__(self) -> Iterator[Any]:
        return iter(self.callbacks)

    def __len__(self) -> int:
        return len(self.callbacks)


def _looks_like_callback(obj: Any) -> bool:
    """Whether `obj` is a single duck-typed callback rather than a collection of them."""
    return not isinstance(obj, (list, tuple)) and any(hasattr(obj, h) for h in HOOKS)


def _check_callback(index: int, cb: Any) -> None:
    """Raise a TypeError naming the fix when `cb` cannot serve as a callback."""
    if isinstance(cb, type):
        raise TypeError(f"callbacks[{index}] is the class {cb.__name__}, not an instance; "
                        f"pass {cb.__name__}(...) instead.")
    if not isinstance(cb, Callback) and not any(callable(getattr(cb, h, None)) for h in HOOKS):
        raise TypeError(f"callbacks[{index}] is {cb!r} of type {type(cb).__name__}; expected a "
                        "fitdp.callbacks.Callback. Subclass Callback or use LambdaCallback.")
