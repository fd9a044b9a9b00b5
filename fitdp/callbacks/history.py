"""`History`: the per-epoch logs `fit` returns, and a plot of them."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from fitdp.callbacks.base import Callback
from fitdp.checks import fail


class History(Callback):
    """Records every epoch's logs; `fit` returns it (a new one per `fit`, as in Keras 3).

    Attributes:
        history: `dict[str, list[float]]`, one value per epoch for each log key.
        throughput: `dict[str, list[float]]`, one value per epoch: `samples_per_sec` and,
            for sequence data, `tokens_per_sec` (see `docs/callbacks.md`). Kept apart from
            `history` so that its keys stay Keras's (those of the epoch logs).
        epoch: the epoch indices (0-based) the values belong to.
        model: the model it recorded, held by a weak reference: the model keeps its History
            (`model.history`), and a strong reference back would make the pair a cycle that
            only the garbage collector frees, worker threads included; `del model` frees
            them at once. None once the model is gone.

    Example:
        >>> h = History()
        >>> h.on_train_begin()
        >>> h.on_epoch_end(0, {"loss": 0.9, "val_loss": 1.0})
        >>> h.history["val_loss"], h.epoch
        ([1.0], [0])
    """

    needs_batch_logs = False  # epoch logs only

    def __init__(self) -> None:
        super().__init__()
        self.history: dict[str, list[float]] = {}
        self.throughput: dict[str, list[float]] = {}
        self.epoch: list[int] = []
        self._last_logs: dict[str, float] | None = None
        self._recorded: set[str] = set()  # keys of `_last_logs` taken at its epoch's end

    @property  # type: ignore[override]
    def model(self) -> Any:
        ref = self.__dict__.get("_model_ref")
        return None if ref is None else ref()

    @model.setter
    def model(self, model: Any) -> None:
        self._model_ref: Callable[[], Any] | None
        try:
            self._model_ref = None if model is None else weakref.ref(model)
        except TypeError:  # an object without weak references: held as it is
            self._model_ref = lambda: model

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (and deep-copied) with the model in place of the weak reference."""
        return {**self.__dict__, "_model_ref": self.model}

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        model = state.pop("_model_ref", None)
        self.__dict__.update(state)
        self.model = model

    def on_train_begin(self, logs: dict[str, float] | None = None) -> None:
        # A reused History starts over; a resumed fit loads its state after this.
        self.history, self.epoch, self.throughput = {}, [], {}
        self._last_logs = None

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        self.epoch.append(int(epoch))
        for key, value in (logs or {}).items():
            self.history.setdefault(key, []).append(float(value))
        for key, value in (getattr(self.model, "throughput", None) or {}).items():
            self.throughput.setdefault(key, []).append(float(value))
        # History runs first (so checkpoints hold this epoch); keys that later callbacks add
        # to the same logs dict are picked up by `_backfill`.
        self._last_logs = logs
        self._recorded = set(logs or {})
        model = self.model
        if model is not None:  # as Keras's: a fit that fails later leaves its epochs there
            model.history = self

    def on_epoch_begin(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        self._backfill()

    def on_train_end(self, logs: dict[str, float] | None = None) -> None:
        self._backfill()

    def _backfill(self) -> None:
        """Record the values other callbacks added to the last epoch's logs after this one
        (a key of only some epochs, like `val_loss` with `validation_freq`, is not one)."""
        for key, value in (self._last_logs or {}).items():
            if key in self._recorded:
                continue
            self._recorded.add(key)  # idempotent: at most once per epoch
            self.history.setdefault(key, []).append(float(value))

    def state_dict(self) -> dict[str, Any]:
        """The recorded epochs, values and throughput (plain lists: loads with
        `weights_only=True`)."""
        self._backfill()
        state: dict[str, Any] = {"history": {k: list(v) for k, v in self.history.items()},
                                 "epoch": list(self.epoch)}
        if self.throughput:  # (recorded by a fit; a History driven by hand has none)
            state["throughput"] = {k: list(v) for k, v in self.throughput.items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a resumed run's history (called after `on_train_begin`)."""
        self.history = {k: [float(x) for x in v] for k, v in state["history"].items()}
        self.epoch = [int(e) for e in state["epoch"]]
        self.throughput = {k: [float(x) for x in v]
                           for k, v in state.get("throughput", {}).items()}

    def plot(self, path: str | None = None, keys: list[str] | None = None) -> Any:
        """Draw each quantity on its own subplot, train and `val_` curves together.

        Args:
            path: when given, the figure is also saved there (format from the extension).
            keys: the quantities to draw without the `val_` prefix, e.g. `["loss"]` (a single
                string is accepted); default every recorded one.

        Returns:
            The `matplotlib.figure.Figure`.

        Raises:
            ImportError: matplotlib is not installed.
            ValueError: nothing was recorded, or a key in `keys` was not.
        """
        try:
            from matplotlib.figure import Figure
            from matplotlib.ticker import MaxNLocator
        except ImportError as e:
            raise ImportError("History.plot needs matplotlib, which is not installed. "
                              "Install it with `pip install matplotlib`.") from e
        bases = list(dict.fromkeys(k[4:] if k.startswith("val_") else k for k in self.history))
        if not bases:
            raise ValueError("History.plot has nothing to draw: no epoch was recorded. "
                             "Call it on the History that fit returned, after fit.")
        keys = bases if keys is None else [keys] if isinstance(keys, str) else list(keys)
        missing = [k for k in keys if k not in bases]
        if missing or not keys:
            fail("History.plot(keys=...)", keys, f"a non-empty list drawn from {bases}",
                 f"drop {missing}: never recorded" if missing else "")
        # Figure() without pyplot: no GUI backend, no global state, safe on headless machines.
        fig = Figure(figsize=(5 * len(keys), 3.6), layout="constrained")
        axes = fig.subplots(1, len(keys), squeeze=False)[0]
        for ax, key in zip(axes, keys):
            for name, label in ((key, "train"), (f"val_{key}", "validation")):
                values = self.history.get(name)
                if values:
                    ax.plot(self._xs(len(values)), values, marker=".", label=label)
            ax.set_title(key)
            ax.set_xlabel("epoch")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.legend()
        if path is not None:
            fig.savefig(path)
        return fig

    def _xs(self, n: int) -> list[int]:
        """1-based epoch numbers for a series of `n` values (the last `n` epochs)."""
        epochs = self.epoch[-n:] if len(self.epoch) >= n else list(range(n))
        return [e + 1 for e in epochs]
