"""BackupAndRestore: the rolling backup, its previous copy as a fallback, async saves."""

from __future__ import annotations

import os
import warnings

import pytest
from callback_helpers import attach

from fitdp.callbacks import BackupAndRestore, TerminateOnNaN
from fitdp.saving.checkpoint import load_checkpoint


def test_backup_and_restore_paths(tmp_path):
    backup = BackupAndRestore(str(tmp_path / "bk"))
    model = attach(backup)
    assert backup.resume_path() is None and backup.latest_checkpoint() is None
    backup.on_train_begin({})
    backup.on_epoch_end(0, {"loss": 1.0})
    path = str(tmp_path / "bk" / "backup.ckpt")
    assert backup.resume_path() == path == backup.latest_checkpoint()
    assert load_checkpoint(path)["step"] == 0
    backup.on_train_end({})
    assert backup.resume_path() is None and not (tmp_path / "bk").exists()
    kept = BackupAndRestore(tmp_path / "bk2", save_freq=2, delete_checkpoint=False)
    attach(kept, model)
    kept.on_train_begin({})
    for step in range(1, 4):
        model.global_step = step
        kept.on_train_batch_end(step - 1, {})
        kept.on_epoch_end(0, {})  # int save_freq: no epoch saves
    kept.on_train_end({})
    assert model.saved[-1] == str(tmp_path / "bk2" / "backup.ckpt") and len(model.saved) == 2
    assert load_checkpoint(kept.resume_path())["step"] == 2


def test_backup_argument_errors(tmp_path):
    with pytest.raises(ValueError, match=r"BackupAndRestore\(save_freq=...\): got -1"):
        BackupAndRestore(tmp_path, save_freq=-1)
    with pytest.raises(ValueError, match="save_freq"):
        BackupAndRestore(tmp_path, save_freq="batch")  # Keras refuses it too
    with pytest.raises(TypeError, match=r"backup_dir=...\): got ''"):
        BackupAndRestore("")


def test_backup_saves_once_per_optimizer_step(tmp_path):
    """With gradient accumulation several batches share a step: one backup per step."""
    backup = BackupAndRestore(tmp_path / "bk", save_freq=1)
    model = attach(backup)
    backup.on_train_begin({})
    for batch in range(4):
        model.global_step = batch // 2 + 1
        backup.on_train_batch_end(batch, {})
    assert len(model.saved) == 2


def _interrupted_run(tmp_path, epochs: int, **kw) -> tuple[BackupAndRestore, object]:
    backup = BackupAndRestore(tmp_path / "bk", double_checkpoint=True, **kw)
    model = attach(backup)
    backup.on_train_begin({})
    for epoch in range(epochs):  # no on_train_end: the run was interrupted
        model.global_step = 10 * (epoch + 1)
        backup.on_epoch_end(epoch, {"loss": 1.0})
    return backup, model


def test_double_checkpoint_keeps_the_previous_backup(tmp_path):
    backup, model = _interrupted_run(tmp_path, epochs=3)
    assert sorted(os.listdir(tmp_path / "bk")) == ["backup.ckpt", "backup.prev.ckpt"]
    assert load_checkpoint(backup.path)["step"] == 30
    assert load_checkpoint(backup.previous_path)["step"] == 20
    assert backup.resume_path() == backup.path
    backup.on_train_end({})
    assert not (tmp_path / "bk").exists()


def test_double_checkpoint_falls_back_when_the_latest_is_damaged(tmp_path):
    """Keras 3 (backup_and_restore_test, test_backup_corrupted): with double_checkpoint, a
    latest backup that cannot be loaded makes the next fit resume from the previous one."""
    backup, _ = _interrupted_run(tmp_path, epochs=3)
    with open(backup.path, "r+b") as f:  # one flipped byte inside a record
        f.seek(200)
        byte = f.read(1)
        f.seek(200)
        f.write(bytes([byte[0] ^ 0xFF]))
    again = BackupAndRestore(tmp_path / "bk", double_checkpoint=True)
    model = attach(again)
    with pytest.warns(UserWarning, match=r"latest backup is damaged .*previous one"):
        assert again.resume_path() == again.previous_path
    assert load_checkpoint(again.resume_path())["step"] == 20
    assert (tmp_path / "bk" / "backup.ckpt.damaged").exists()
    # The resumed run's next backup leaves the good previous one in place.
    again.on_train_begin({})
    model.global_step = 30
    again.on_epoch_end(2, {})
    assert load_checkpoint(again.path)["step"] == 30
    assert load_checkpoint(again.previous_path)["step"] == 20
    again.on_train_end({})
    assert not (tmp_path / "bk").exists()


def test_a_rank_that_finds_the_damaged_backup_set_aside_warns_too(tmp_path):
    """Under torchrun every rank reads the latest backup; the main one sets a damaged one
    aside, and a rank that looks after that finds it gone. That rank must still say it
    resumes from the previous backup (seen in a 2-rank FSDP run: only rank 0 warned)."""
    backup, _ = _interrupted_run(tmp_path, epochs=3)
    os.replace(backup.path, backup.path + ".damaged")  # what the main rank just did
    with pytest.warns(UserWarning, match=r"latest backup is damaged .*another rank.*previous"):
        assert backup.resume_path() == backup.previous_path
    os.replace(backup.previous_path, backup.path)  # nothing was set aside after all...
    os.remove(backup.path + ".damaged")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # ...and a missing latest alone warns of nothing
        os.replace(backup.path, backup.previous_path)
        assert backup.resume_path() == backup.previous_path


def test_crash_between_rotation_and_save_resumes_from_previous(tmp_path):
    backup, _ = _interrupted_run(tmp_path, epochs=2)
    os.replace(backup.path, backup.previous_path)  # the state right after the rotation
    assert backup.resume_path() == backup.previous_path


def test_damaged_backup_without_previous_is_returned_for_load_to_report(tmp_path):
    backup, _ = _interrupted_run(tmp_path, epochs=1)
    with open(backup.path, "r+b") as f:
        f.truncate(100)
    assert backup.resume_path() == backup.path  # loading it raises CheckpointError


def test_async_backup_rotates_only_complete_files(tmp_path):
    backup, model = _interrupted_run(tmp_path, epochs=1, async_save=True)
    assert not os.path.exists(backup.path)  # still in flight
    model.global_step = 20
    backup.on_epoch_end(1, {})  # waits for the first, rotates it, starts the second
    assert load_checkpoint(backup.previous_path)["step"] == 10
    assert not os.path.exists(backup.path)
    backup.on_train_end({})  # waits for the second, then deletes both
    assert not (tmp_path / "bk").exists() and model.saved == [backup.path] * 2


def test_async_backup_error_is_raised_at_train_end(tmp_path):
    backup = BackupAndRestore(tmp_path / "bk", async_save=True, delete_checkpoint=False)
    model = attach(backup)
    backup.on_train_begin({})
    backup.on_epoch_end(0, {})
    model.fail_async = True
    with pytest.raises(OSError, match="backup.ckpt failed"):
        backup.on_train_end({})


def test_nan_with_raise_error_keeps_the_backup(tmp_path):
    """Keras 3 (terminate_on_nan_test, test_raise_error_terminate_preserves_backup): the
    RuntimeError ends fit before on_train_end, so BackupAndRestore does not delete."""
    backup = BackupAndRestore(tmp_path / "bk")
    stop = TerminateOnNaN(raise_error=True)
    model = attach(backup)
    attach(stop, model)
    backup.on_train_begin({})
    backup.on_epoch_end(0, {})
    with pytest.raises(RuntimeError, match="NaN or Inf loss"):
        stop.on_train_batch_end(0, {"loss": float("nan")})
    assert backup.resume_path() == backup.path
