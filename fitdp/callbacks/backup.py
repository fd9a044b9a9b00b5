"""`BackupAndRestore`: a rolling backup a crashed `fit` resumes from automatically."""

from __future__ import annotations

import os
from typing import Any

from fitdp.callbacks._monitor import check_save_freq, step_save_due
from fitdp.callbacks.base import Callback


class BackupAndRestore(Callback):
    """Keeps `backup_dir/backup.ckpt` up to date so an interrupted `fit` can resume (Keras).

    The backup is written with `model.save` (atomic: a crash leaves the previous backup or the
    new one, never a broken file) at each epoch end or every N optimizer steps. Before training,
    `fit` asks `resume_path()` and, when a backup exists, resumes from it. After a successful
    `fit` the backup is deleted (unless `delete_checkpoint=False`), so the next `fit` starts
    fresh. Only the main process writes or deletes.

    Args:
        backup_dir: folder of the backup (created when needed). Use one folder per run.
        save_freq: "epoch" or an int N (every N optimizer steps, `model.global_step`).
        delete_checkpoint: delete the backup when `fit` completes.

    Raises:
        TypeError: `backup_dir` is not a non-empty string or path.
        ValueError: `save_freq` is neither "epoch" nor a positive int.

    Example:
        >>> backup = BackupAndRestore("/tmp/run1-backup", save_freq=500)
        >>> backup.resume_path() is None or backup.resume_path().endswith("backup.ckpt")
        True
    """

    FILENAME = "backup.ckpt"

    def __init__(self, backup_dir: str | os.PathLike[str], save_freq: str | int = "epoch",
                 delete_checkpoint: bool = True) -> None:
        super().__init__()
        if not isinstance(backup_dir, (str, os.PathLike)) or not os.fspath(backup_dir):
            raise TypeError(f"BackupAndRestore(backup_dir=...) got {backup_dir!r}; expected a "
                            "non-empty folder path such as 'runs/backup'.")
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq = check_save_freq(save_freq, "BackupAndRestore")
        self.delete_checkpoint = bool(delete_checkpoint)
        self.path = os.path.join(self.backup_dir, self.FILENAME)
        self._last_step = 0

    def resume_path(self) -> str | None:
        """The backup file when one exists (an earlier `fit` did not finish), else None."""
        return self.path if os.path.isfile(self.path) else None

    def latest_checkpoint(self) -> str | None:
        """Same as `resume_path()`, for `fit(resume="latest")`."""
        return self.resume_path()

    def _backup(self) -> None:
        if self._is_main_process():
            os.makedirs(self.backup_dir, exist_ok=True)
            self.model.save(self.path)

    def on_train_batch_end(self, batch: int, logs: dict[str, float] | None = None) -> None:
        step = int(self.model.global_step)
        if step_save_due(self.save_freq, step, self._last_step):
            self._last_step = step
            self._backup()

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        if self.save_freq == "epoch":
            self._backup()

    def on_train_end(self, logs: dict[str, float] | None = None) -> None:
        # The model calls on_train_end only after a successful run: the backup has served.
        if self.delete_checkpoint and self._is_main_process():
            try:
                os.remove(self.path)
                os.rmdir(self.backup_dir)  # only when empty: never another run's files
            except OSError:
                pass

    def state_dict(self) -> dict[str, Any]:
        """The last step backed up, so a resumed run does not back up the same step twice."""
        return {"last_step": self._last_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        self._last_step = int(state.get("last_step", 0))
