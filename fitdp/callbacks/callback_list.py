"""`CallbackList`, the model's one dispatcher, and the stable keys callback states are saved by."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from fitdp.callbacks.base import HOOK_ALIASES, HOOKS, Callback
from fitdp.callbacks.history import History
from fitdp.callbacks.progress import ProgressBar
from fitdp.checks import fail

_BATCH_END_HOOKS = ("on_train_batch_end", "on_test_batch_end")


class CallbackList:
    """The model's view of its callbacks: one `call(hook_name, *args)` dispatches to all.

    Only callbacks that override a hook are called for it (precomputed), so a batch hook nobody
    overrides costs one dict lookup. User callbacks keep their order; a `History` goes before
    them (so a checkpoint saved in a user's `on_epoch_end` holds that epoch) and a
    `ProgressBar` last, unless the user passed their own.

    Args:
        callbacks: `Callback` objects (or one), in the order their hooks run.
        model: the model to attach to every callback (`set_model`).
        add_history: insert a `History` first when none is given.
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
        self._model: Any = None
        self._params: dict[str, Any] | None = None
        self._hooks: dict[str, list[Callable[..., Any]]] = {hook: [] for hook in HOOKS}
        self._rebuild()
        if model is not None:
            self.set_model(model)
        if params is not None:
            self.set_params(params)

    def _rebuild(self) -> None:
        """Precompute, per hook, the bound methods of the callbacks that override it."""
        for hook, fns in self._hooks.items():  # in place: a loop holding a list sees it
            fns[:] = [getattr(cb, hook) for cb in self.callbacks if _overrides(cb, hook)]
        self._sync = any(getattr(cb, "sync_every_batch", False) is True for cb in self.callbacks)
        # A duck-typed callback without the attribute is assumed to read its batch logs.
        self._needs_logs = any(
            getattr(cb, "needs_batch_logs", True) is not False
            for cb in self.callbacks if any(_overrides(cb, h) for h in _BATCH_END_HOOKS))

    def call(self, hook_name: str, *args: Any) -> None:
        """Run `hook_name(*args)` on every callback that overrides it, in order.

        Raises:
            ValueError: `hook_name` is not one of the hook names in `HOOKS`.
        """
        try:
            fns = self._hooks[hook_name]
        except KeyError:
            fail("CallbackList.call(hook_name=...)", hook_name, "one of " + ", ".join(HOOKS))
        for fn in fns:
            fn(*args)

    def append(self, callback: Callback) -> None:
        """Add a callback after the others (it gets the model and params already set)."""
        _check_callback(len(self.callbacks), callback)
        self.callbacks.append(callback)
        if self._model is not None:
            callback.set_model(self._model)
        if self._params is not None:
            callback.set_params(self._params)
        self._rebuild()

    def set_model(self, model: Any) -> None:
        """Attach `model` to every callback."""
        self._model = model
        for cb in self.callbacks:
            if hasattr(cb, "set_model"):
                cb.set_model(model)

    @property
    def params(self) -> dict[str, Any]:
        """The run parameters last given to ``set_params`` (a copy; empty before)."""
        return dict(self._params or {})

    def set_params(self, params: dict[str, Any]) -> None:
        """Pass the run parameters (`epochs`, `steps`, `verbose`, `batch_size`, `resumed`,
        `log_every`)."""
        self._params = dict(params)
        for cb in self.callbacks:
            if hasattr(cb, "set_params"):
                cb.set_params(self._params)

    def state_dict(self) -> dict[str, Any]:
        """Each callback's non-empty state, under its key from `state_keys`."""
        states = {}
        for key, cb in zip(state_keys(self.callbacks), self.callbacks):
            save = getattr(cb, "state_dict", None)
            state = save() if callable(save) else None
            if isinstance(state, dict) and state:
                states[key] = state
        return states

    def problem(self, states: Mapping[str, Any], checkpoint: Mapping[str, Any]) -> str | None:
        """Why ``states`` cannot load (checked with the rest of a checkpoint, before any
        entry is applied), or None."""
        if not all(isinstance(s, Mapping) for s in states.values()):
            return "it is not a dict of callback states by state_key"
        return None

    def load_state_dict(self, states: dict[str, Any]) -> None:
        """Give each callback the state saved under its key; keys nobody has are ignored.

        The model calls it after `on_train_begin`, so restored state is not reset.
        """
        for key, cb in zip(state_keys(self.callbacks), self.callbacks):
            if key in states and callable(getattr(cb, "load_state_dict", None)):
                cb.load_state_dict(states[key])

    @property
    def sync_every_batch(self) -> bool:
        """True when some callback needs the exact loss after every batch, on any device."""
        return self._sync

    @property
    def names_phases(self) -> bool:
        """True when some callback profiles the call (`names_phases`): its step is bound with
        fitdp's phases as named ranges for the trace."""
        return any(getattr(cb, "names_phases", False) is True for cb in self.callbacks)

    @property
    def logs_grad_norm(self) -> bool:
        """True when some callback wants the gradients' norm in the logs (`logs_grad_norm`):
        the call's optimizer steps take it on the device."""
        return any(getattr(cb, "logs_grad_norm", False) is True for cb in self.callbacks)

    @property
    def needs_batch_logs(self) -> bool:
        """True when a callback with a batch-end hook reads its logs (`needs_batch_logs`): the
        model then reads exact logs every batch where that costs no device sync (CPU)."""
        return self._needs_logs

    def hook(self, hook_name: str) -> list[Callable[..., Any]]:
        """The methods that ``call(hook_name, ...)`` runs, in order: the list itself, kept
        current as callbacks are added (a batch loop tests it before each call)."""
        return self._hooks[hook_name]

    def listens(self, hook_name: str) -> bool:
        """Whether some callback does something in `hook_name` (it gets called at all)."""
        return bool(self._hooks.get(hook_name))

    @property
    def history(self) -> Any:
        """The `History` callback of this list, or None when there is none."""
        return self._history

    def __iter__(self) -> Iterator[Any]:
        return iter(self.callbacks)

    def __len__(self) -> int:
        return len(self.callbacks)


def state_keys(callbacks: Sequence[Any]) -> list[str]:
    """One unique checkpoint key per callback, in order: its `state_key` (the class name for
    duck-typed ones), with `#2`, `#3`, ... added to the second and later of equal keys.

    Example:
        >>> from fitdp.callbacks import EarlyStopping, History
        >>> state_keys([History(), EarlyStopping(), EarlyStopping(), EarlyStopping("loss")])
        ['History', 'EarlyStopping[val_loss]', 'EarlyStopping[val_loss]#2', 'EarlyStopping[loss]']
    """
    keys: list[str] = []
    taken: set[str] = set()
    for cb in callbacks:
        base = getattr(cb, "state_key", None)
        if not isinstance(base, str) or not base:
            base = type(cb).__name__
        key, n = base, 1
        while key in taken:
            n += 1
            key = f"{base}#{n}"
        taken.add(key)
        keys.append(key)
    return keys


def _overrides(cb: Any, hook: str) -> bool:
    """Whether `cb` does something in `hook` (subclass method, instance attribute or duck type)."""
    names = (hook, HOOK_ALIASES[hook]) if hook in HOOK_ALIASES else (hook,)
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


def _looks_like_callback(obj: Any) -> bool:
    """Whether `obj` is a single duck-typed callback rather than a collection of them."""
    return not isinstance(obj, (list, tuple)) and any(hasattr(obj, h) for h in HOOKS)


def _check_callback(index: int, cb: Any) -> None:
    """Raise a TypeError naming the fix when `cb` cannot serve as a callback."""
    if isinstance(cb, type):
        fail(f"callbacks[{index}]", f"the class {cb.__name__}", "a callback instance",
             f"pass {cb.__name__}(...) instead", error=TypeError, described=True)
    if not isinstance(cb, Callback) and not any(callable(getattr(cb, h, None)) for h in HOOKS):
        fail(f"callbacks[{index}]", cb, "a fitdp.callbacks.Callback",
             "subclass Callback or use LambdaCallback", error=TypeError)
