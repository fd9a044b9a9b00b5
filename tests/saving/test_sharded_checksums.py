"""Sharded checkpoints (the folder form of ``model.save(..., sharded=True)``) carry a checksum
of every file (issue 28, items 1 and 13): a damaged, truncated or missing file is a
``CheckpointError`` naming it, raised before any weight changes, as a damaged one-file
checkpoint is (docs/checkpoints.md, "Sealed"); ``BackupAndRestore(double_checkpoint=True)``
falls back from a damaged sharded backup as docs/callbacks.md promises; the step folder is
named after the global step."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import fitdp
from fitdp.callbacks import BackupAndRestore
from fitdp.saving.sharded import load_sharded, save_sharded

X = torch.randn(48, 6, generator=torch.Generator().manual_seed(0))
Y = (X[:, 0] > 0).long() + (X[:, 1] > 0).long()


def model(seed: int = 0) -> fitdp.Model:
    torch.manual_seed(seed)
    m = fitdp.Model(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)))
    m.compile(optimizer="adamw", lr=0.05, loss="cross_entropy")
    return m


def fit(m: fitdp.Model, epochs: int, **kwargs) -> None:
    m.fit(X, Y, batch_size=8, epochs=epochs, shuffle=False, verbose=0, devices=["cpu"],
          **kwargs)


def saved(path: Path) -> Path:
    """A sharded checkpoint at ``path`` after 6 optimizer steps; returns its step folder."""
    m = model()
    fit(m, 1)
    m.save(path, sharded=True)
    return path / (path / "LATEST").read_text()


def overwrite_a_weight(step: Path, weight: torch.Tensor) -> Path:
    """Write inf over the first value of ``weight`` where the shard file holds it (what a
    flipped disk block does to a checkpoint: the file still parses)."""
    shard = step / "__0_0.distcp"
    data = shard.read_bytes()
    at = data.index(weight.detach().numpy().tobytes())
    shard.write_bytes(data[:at] + b"\x00\x00\x80\x7f" + data[at + 4:])  # float32 inf
    return shard


def assert_refused_unchanged(path: Path, names: Path) -> None:
    """Loading ``path`` raises CheckpointError naming the file ``names``, and a model that
    tried (load, then fit(resume=...)) holds the weights and step it had."""
    m = model(seed=1)
    before = m.get_weights()
    with pytest.raises(fitdp.CheckpointError, match=re.escape(str(names))):
        m.load(path)
    with pytest.raises(fitdp.CheckpointError, match=re.escape(str(names))):
        fit(m, 2, resume=path)
    after = m.get_weights()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert m.global_step == 0


def test_corrupted_shard_bytes_raise_checkpoint_error_naming_the_file_before_any_change(
        tmp_path):
    """4 bytes of weights overwritten in a shard file loaded silently (the model got inf)."""
    step = saved(tmp_path / "c.ckpt")
    shard = overwrite_a_weight(step, load_sharded(tmp_path / "c.ckpt")["module"]["2.weight"])
    assert_refused_unchanged(tmp_path / "c.ckpt", shard)


def test_a_truncated_shard_raises_checkpoint_error_naming_the_file(tmp_path):
    """Was torch's CheckpointException ("failed finding central directory"), naming no file."""
    shard = saved(tmp_path / "c.ckpt") / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    assert_refused_unchanged(tmp_path / "c.ckpt", shard)


def test_a_missing_shard_file_raises_checkpoint_error_naming_the_file(tmp_path):
    shard = saved(tmp_path / "c.ckpt") / "__0_0.distcp"
    shard.unlink()
    assert_refused_unchanged(tmp_path / "c.ckpt", shard)


@pytest.mark.parametrize("name", [".metadata", "state.ckpt", "checksums.json"])
def test_every_file_of_a_sharded_checkpoint_is_checked(tmp_path, name):
    """DCP's index, rank 0's file and the checksums themselves: one flipped byte in any of
    them is a CheckpointError naming that file."""
    target = saved(tmp_path / "c.ckpt") / name
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    assert_refused_unchanged(tmp_path / "c.ckpt", target)


def test_a_sharded_checkpoint_without_checksums_is_refused(tmp_path):
    """A step folder whose checksums file is gone (not written by this fitdp, or a save cut
    before it) is not trusted: nothing says its shards are the ones saved."""
    target = saved(tmp_path / "c.ckpt") / "checksums.json"
    target.unlink()
    assert_refused_unchanged(tmp_path / "c.ckpt", target)


def test_the_checksums_do_not_depend_on_torchs_crc_option(tmp_path):
    """The per-file CRC-32s are fitdp's own (zlib): a user who turned torch.save's CRCs off
    process-wide still gets every shard checked."""
    was_on = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        shard = saved(tmp_path / "c.ckpt") / "__0_0.distcp"
    finally:
        torch.serialization.set_crc32_options(was_on)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(fitdp.CheckpointError, match=re.escape(str(shard))):
        load_sharded(tmp_path / "c.ckpt")


def test_an_fsdp_checkpoint_folder_is_named_after_the_global_step(tmp_path):
    """Was step-1 at global_step 60 (it counted saves): 48 rows in batches of 8 = 6 steps an
    epoch; saved after 1 epoch then after 2 into the same folder."""
    m = model()
    fit(m, 1)
    m.save(tmp_path / "c.ckpt", sharded=True)
    assert (tmp_path / "c.ckpt" / "LATEST").read_text() == "step-6"
    fit(m, 2, resume=tmp_path / "c.ckpt")
    assert m.global_step == 12
    m.save(tmp_path / "c.ckpt", sharded=True)
    assert sorted(os.listdir(tmp_path / "c.ckpt")) == ["LATEST", "step-12"]
    assert sorted(os.listdir(tmp_path / "c.ckpt" / "step-12")) == [
        ".metadata", "__0_0.distcp", "checksums.json", "state.ckpt"]


def test_a_second_sharded_save_at_one_step_never_touches_the_complete_one(tmp_path):
    """Two saves at global step 6 into one folder: the second goes to step-6.1 and LATEST
    moves only once it is complete; a third returns to step-6. Each loads whole."""
    m = model()
    fit(m, 1)
    for name in ("step-6", "step-6.1", "step-6"):
        m.save(tmp_path / "c.ckpt", sharded=True)
        assert sorted(os.listdir(tmp_path / "c.ckpt")) == ["LATEST", name]
        assert load_sharded(tmp_path / "c.ckpt")["run"]["global_step"] == 6


def test_a_damaged_latest_sharded_backup_warns_and_fit_resumes_from_the_previous_one(
        tmp_path):
    """double_checkpoint with sharded backups: the latest backup's shard damaged, fit warns,
    sets it aside and resumes from the previous backup (step 6): it ends where an
    uninterrupted fit does, bit for bit (was: resumed from the damaged one, weights inf)."""
    folder = tmp_path / "b"
    backup = BackupAndRestore(folder, double_checkpoint=True)
    m = model()
    fit(m, 1)
    m.save(backup.previous_path, sharded=True)  # step 6
    fit(m, 2, resume=backup.previous_path)
    m.save(backup.path, sharded=True)  # step 12
    latest = Path(backup.path) / (Path(backup.path) / "LATEST").read_text()
    shard = overwrite_a_weight(latest, m.get_weights()["0.weight"])
    uninterrupted = model()
    fit(uninterrupted, 3)
    resumed = model(seed=1)
    with pytest.warns(UserWarning, match=re.escape(str(shard))):
        fit(resumed, 3, callbacks=[BackupAndRestore(folder, double_checkpoint=True,
                                                    delete_checkpoint=False)])
    assert resumed.history.params["resumed"]["step"] == 6
    want, got = uninterrupted.get_weights(), resumed.get_weights()
    assert all(torch.equal(got[k], v) for k, v in want.items())
    assert (folder / "backup.ckpt.damaged" / latest.name / "__0_0.distcp").is_file()


def test_save_sharded_names_the_step_it_is_given(tmp_path):
    save_sharded(str(tmp_path / "c"), {"module": {"w": torch.ones(3)}, "run": {}}, step=60)
    assert (tmp_path / "c" / "LATEST").read_text() == "step-60"
