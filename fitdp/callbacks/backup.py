"""`BackupAndRestore`: a rolling backup a crashed `fit` resumes from automatically."""

from __future__ import annotations

import os
import warnings
from typing import Any

from fitdp.callbacks._save_freq import check_save_freq, step_save_due
from fitdp.callbacks.base import Callback
from fitdp.checks import check_bool, check_folder, check_path_arg
from fitdp.saving.seal import CheckpointError, verify
from fitdp.saving.sharded import is_checkpoint, remove_checkpoint, verify_sharded


class BackupAndRestore(Callback):
    """Keeps `backup_dir/backup.ckpt` up to date so an interrupted `fit` can resume (Keras).

    The backup is written with `model.save` (atomic: a crash leaves the previous backup or the
    new one, never a broken file) at each epoch end or every N optimizer steps. Before training,
    `fit` asks `resume_path()` and, when a backup exists, resumes from it. After a successful
    `fit` the backup is deleted (unless `delete_checkpoint=False`), so the next `fit` starts
    fresh. Only the main process writes or deletes; with `strategy="fsdp"` every rank takes
    part in each backup (each writes its shards: the backup is then a folder of that name).

    With `double_checkpoint=True` the backup before the latest is kept as
    `backup_dir/backup.prev.ckpt`; when the latest is missing or damaged (its seal or a record
    CRC does not match, see `saving.seal.verify`; for a sharded backup, any file of it is
    missing or differs in size or CRC-32 from what its save recorded), `resume_path()` warns,
    sets the damaged one aside as `backup.ckpt.damaged` and returns the previous one (Keras 3).
    Under torchrun every rank checks every file itself (the same bytes, the same verdict; a
    rank that looks after rank 0 set the damaged backup aside finds it gone), so all ranks
    resume from the same backup.

    Args:
        backup_dir: folder of the backup (created when needed). Use one folder per run.
        save_freq: "epoch" or an int N (every N optimizer steps, `model.global_step`).
        delete_checkpoint: delete the backup when `fit` completes.
        double_checkpoint: keep the previous backup too, as a fallback (twice the disk).
        async_save: `model.save(path, async_save=True)`: training goes on while a background
            thread writes the backup.

    Raises:
        TypeError: `backup_dir` is not a non-empty string or path; a flag is not a bool.
        ValueError: `save_freq` is neither "epoch" nor a positive int; `backup_dir` is (or
            is under) a file.

    Example:
        >>> backup = BackupAndRestore("/tmp/run1-backup", save_freq=500, double_checkpoint=True)
        >>> backup.resume_path() is None or backup.resume_path().endswith(".ckpt")
        True
    """

    FILENAME = "backup.ckpt"
    PREVIOUS = "backup.prev.ckpt"
    needs_batch_logs = False  # counts optimizer steps; never reads the logs

    def __init__(self, backup_dir: str | os.PathLike[str], save_freq: str | int = "epoch",
                 delete_checkpoint: bool = True, *, double_checkpoint: bool = False,
                 async_save: bool = False) -> None:
        super().__init__()
        self.backup_dir = check_path_arg("BackupAndRestore(backup_dir=...)", backup_dir,
                                         "'runs/backup'")
        check_folder("BackupAndRestore(backup_dir=...)", self.backup_dir)
        self.save_freq = check_save_freq(save_freq, "BackupAndRestore", "optimizer steps")
        self.delete_checkpoint = check_bool("BackupAndRestore(delete_checkpoint=...)",
                                            delete_checkpoint)
        self.double_checkpoint = check_bool("BackupAndRestore(double_checkpoint=...)",
                                            double_checkpoint)
        self.async_save = check_bool("BackupAndRestore(async_save=...)", async_save)
        self.path = os.path.join(self.backup_dir, self.FILENAME)
        self.previous_path = os.path.join(self.backup_dir, self.PREVIOUS)
        self._pending = False  # an async save may still be writing
        self._last_step = 0

    @property
    def state_key(self) -> str:
        """`BackupAndRestore[<backup_dir>]`."""
        return f"BackupAndRestore[{self.backup_dir}]"

    def check_fit(self, params: dict[str, Any]) -> None:
        """The backup folder can still be made (a file put there since is found now)."""
        check_folder("BackupAndRestore(backup_dir=...)", self.backup_dir)

    def resume_path(self) -> str | None:
        """The backup to resume from (an earlier `fit` did not finish), else None.

        With `double_checkpoint`, the latest backup is verified first (one read of each of
        its files) and the previous one is returned when the latest is missing or damaged.
        """
        if not self.double_checkpoint:
            return self.path if is_checkpoint(self.path) else None
        try:
            if os.path.isdir(self.path):  # a sharded backup (strategy="fsdp")
                verify_sharded(self.path)
            else:
                with open(self.path, "rb") as f:
                    verify(f, self.path)
            return self.path
        except FileNotFoundError:  # no backup, or another rank just set a damaged one aside
            if os.path.exists(self.path + ".damaged") and is_checkpoint(self.previous_path):
                self._warn_damaged("set aside by another rank as it was read", stacklevel=3)
        except CheckpointError as e:
            if not is_checkpoint(self.previous_path):
                return self.path  # nothing to fall back to: loading it reports the damage
            self._set_aside(e)
        return self.previous_path if is_checkpoint(self.previous_path) else None

    def _warn_damaged(self, error: object, stacklevel: int) -> None:
        """Every rank says it resumes from the previous backup (the warning names the one
        whose caller called ``resume_path``)."""
        warnings.warn(f"BackupAndRestore: the latest backup is damaged ({error}); resuming from "
                      f"the previous one, {self.previous_path}. The damaged file is kept as "
                      f"{self.path}.damaged.", UserWarning, stacklevel=stacklevel + 1)

    def _set_aside(self, error: CheckpointError) -> None:
        """Move a damaged latest backup out of the rotation (kept for inspection)."""
        damaged = self.path + ".damaged"
        self._warn_damaged(error, stacklevel=4)
        if self._is_main_process():
            if os.path.isdir(damaged):  # os.replace replaces only files
                remove_checkpoint(damaged)
            os.replace(self.path, damaged)

    def latest_checkpoint(self) -> str | None:
        """Same as `resume_path()`, for `fit(resume="latest")`."""
        return self.resume_path()

    def _backup(self) -> None:
        """Every rank with strategy="fsdp" (each writes its shards), else the main one."""
        self._share_logs()  # every rank: the backup holds each rank's running logs
        if not self._takes_part_in_saves():
            return
        self._wait()  # the backup rotated below must be complete
        if self._is_main_process():
            os.makedirs(self.backup_dir, exist_ok=True)
            if self.double_checkpoint and is_checkpoint(self.path):
                if os.path.isdir(self.previous_path):  # os.replace replaces only files
                    remove_checkpoint(self.previous_path)
                # A crash right after this leaves only the previous backup: resume_path
                # uses it.
                os.replace(self.path, self.previous_path)
        if self.async_save:
            self.model.save(self.path, async_save=True)
            self._pending = True
        else:
            self.model.save(self.path)

    def backup_now(self) -> None:
        """Write the backup of the model as it is now and wait until it is on disk (``fit``
        calls it when the job is preempted, at a step boundary); nothing to do when this
        step's backup was just written."""
        if self.save_freq == "epoch" or self._last_step != int(self.model.global_step):
            self._last_step = int(self.model.global_step)
            self._backup()
        self._wait()

    def _wait(self) -> None:
        if self._pending:
            self.model.wait_for_saves()  # raises the error of a failed background save
            self._pending = False

    def on_train_begin(self, logs: dict[str, float] | None = None) -> None:
        self._last_step = 0

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
        self._wait()
        if self.delete_checkpoint and self._is_main_process():
            for path in (self.path, self.previous_path, self.path + ".damaged"):
                remove_checkpoint(path)
            try:
                os.rmdir(self.backup_dir)  # only when empty: never another run's files
            except OSError:
                pass

    def state_dict(self) -> dict[str, Any]:
        """The last step backed up, so a resumed run does not back up the same step twice."""
        return {"last_step": self._last_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        self._last_step = int(state.get("last_step", 0))
