"""`Callback`, the hook interface every callback implements (Keras hook names)."""

from __future__ import annotations

from typing import Any

# Every hook a model may dispatch, with Keras names. `on_batch_begin/end` are Keras aliases that
# `on_train_batch_begin/end` forward to, so they are not dispatched on their own.
HOOKS: tuple[str, ...] = (
    "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_exception",
    "on_train_batch_begin", "on_train_batch_end",
    "on_test_begin", "on_test_end", "on_test_batch_begin", "on_test_batch_end",
    "on_predict_begin", "on_predict_end", "on_predict_batch_begin", "on_predict_batch_end",
    "on_before_optimizer_step",
)
def is_log_point(batch: int, log_every: int) -> bool:
    """Whether a call reads its logs after ``batch`` (0-based in the epoch): the first batch
    and every ``log_every``-th (``fit(log_every=...)``; 1 where reading costs no sync)."""
    return batch == 0 or (batch + 1) % log_every == 0


HOOK_ALIASES: dict[str, str] = {"on_train_batch_begin": "on_batch_begin",
                                "on_train_batch_end": "on_batch_end"}


class Callback:
    """Base class of every callback: override the hooks you need, Keras style.

    `self.model` is the `fitdp.Model` being trained (set by `set_model`), `self.params` a dict
    with `epochs`, `steps`, `verbose`, `batch_size`, `resumed` (None, or the `path`,
    `epoch` and `step` a resumed fit continues from) and `log_every` (the call's log points:
    `is_log_point(batch, log_every)`). Every `logs` is a `dict[str, float]`; batch logs hold
    the loss and every metric, read at the log points (on a GPU, a few batches old in
    between, unless `sync_every_batch` is True).

    Per-run state is reset in `on_train_begin`, unconditionally: when a fit resumes, the model
    calls `load_state_dict` after `on_train_begin`, so a resumed run continues the saved state.

    Example:
        >>> class PrintLoss(Callback):
        ...     def on_epoch_end(self, epoch, logs=None):
        ...         print(epoch, logs["loss"])
        >>> PrintLoss().on_epoch_end(0, {"loss": 0.5})
        0 0.5
    """

    # True makes the model read the loss on the host every batch (one device sync per batch).
    sync_every_batch: bool = False
    # False: this callback's batch hooks do not read the logs, or only display them throttled,
    # so on the CPU the model need not read exact logs every batch for it.
    needs_batch_logs: bool = True
    # True: the call's step runs its phases (load, forward, backward, reduce, step) inside
    # torch.profiler.record_function ranges, for a profiler's trace (`Profiler`).
    names_phases: bool = False
    # True: every optimizer step takes the global norm of the gradients before clipping, on
    # the device, and the logs hold it as "grad_norm" at each log point (`GradNormLogger`).
    logs_grad_norm: bool = False
    model: Any = None  # class default: subclasses that skip super().__init__() still work

    def __init__(self) -> None:
        self.model: Any = None
        self.params: dict[str, Any] = {}

    def set_model(self, model: Any) -> None:
        """Attach the model the hooks steer (through `model.stop_training` and friends)."""
        self.model = model

    def set_params(self, params: dict[str, Any]) -> None:
        """Receive the run's parameters: `epochs`, `steps`, `verbose`, `batch_size`, `resumed`."""
        self.params = dict(params)

    def check_fit(self, params: dict[str, Any]) -> None:
        """Called while ``fit`` checks its arguments, before anything changes, with the
        run's parameters (`set_params`'s, plus `validates`: whether the fit validates, and
        `initial_epoch`): raise a ValueError naming the argument for what cannot work in this
        fit (a folder that cannot be made, a file-name field the logs will not have), so it
        is not found after an epoch of training."""

    # The field that tells two callbacks of one class apart in a checkpoint (a built-in's
    # file path or monitored key), or None.
    state_field: str | None = None

    @property
    def state_key(self) -> str:
        """The name this callback's state is saved under in a checkpoint (stable across runs).

        The class name, and `[<state_field's value>]` when the class names a `state_field`
        (`EarlyStopping[val_loss]`, `ModelCheckpoint[<filepath>]`).
        `fitdp.callbacks.state_keys` suffixes duplicates (`#2`, `#3`, ...).
        """
        name = type(self).__name__
        return name if self.state_field is None else f"{name}[{getattr(self, self.state_field)}]"

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to resume this callback; empty for stateless ones."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (stateless callbacks ignore it); called after
        `on_train_begin` when a fit resumes."""

    def _is_main_process(self) -> bool:
        """False on non-zero ranks: such a callback must not write files, print or log."""
        return self.model is None or bool(getattr(self.model, "is_main_process", True))

    def _takes_part_in_saves(self) -> bool:
        """Whether this process joins the checkpoint saves: the main process, and with
        ``strategy="fsdp"`` every rank (each writes its own shards, so every rank makes the
        same decisions: the logs they read are combined over the ranks)."""
        return self._is_main_process() or bool(getattr(self.model, "shards_weights", False))

    def _share_logs(self) -> None:
        """Every rank, before a checkpoint save (rank 0's): hand the model's running epoch
        logs of every rank to it (under torchrun a collective, so every rank calls it where
        a save is due, as they all decide alike)."""
        share = getattr(self.model, "share_epoch_logs", None)  # (a test double may lack it)
        if share is not None:
            share()

    def on_train_begin(self, logs: dict[str, float] | None = None) -> None:
        """Called once at the start of `fit`: reset per-run state here."""

    def on_train_end(self, logs: dict[str, float] | None = None) -> None:
        """Called once at the end of a successful `fit`."""

    def on_exception(self, exception: BaseException) -> None:
        """Called when `fit`, `evaluate` or `predict` fails (an error, Ctrl-C or SIGTERM),
        after the model is put back as after its last completed step, before the error is
        raised (Lightning's hook): end what the call started, e.g. mark a tracked run
        failed. An error raised here is a warning; the call's own error is raised."""

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
        """Called after each training batch with the loss and metrics (never empty)."""
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

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        """Called before each optimizer step, after the gradients were reduced over the devices
        and ranks and unscaled, before clipping (Lightning's hook). `self.model.step_state`
        describes the previous step; reading a gradient as a number syncs with the device."""

    def on_predict_batch_end(self, batch: int, logs: dict[str, float] | None = None) -> None:
        """Called after each prediction batch."""
