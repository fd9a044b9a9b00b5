"""A sharded checkpoint folder is read by nothing that can run code, and refused whole when
it holds more or less than its save wrote (issue 37, items 8 and 10).

The checksums of a step folder catch damage, truncation and foreign files, but whoever
writes the folder can recompute them: so the tests here rewrite a file *and* its checksums,
as an attacker would, and expect a ``CheckpointError`` naming the file with no code run
(docs/checkpoints.md, "What the seal guards against"). ``torch.load(weights_only=True)`` is
the model: torch's docs say it restricts the unpickler to tensors, primitive types and dicts,
and fitdp reads DCP's ``.metadata`` the same way, admitting only DCP's own index types.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import resource
import signal
import warnings
import zlib
from pathlib import Path

import pytest
import torch
from test_sharded_checksums import assert_refused_unchanged, fit, model, saved
from torch import nn

import fitdp
from fitdp.callbacks import BackupAndRestore
from fitdp.executor import sharded_io
from fitdp.executor.sharded_io import SUMS
from fitdp.saving.sharded import load_sharded


class RunsCode:
    """Unpickles as a call that writes ``marker`` (what ``os.system`` would do, visibly)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def rewrite_index(step: Path, change) -> Path:
    """Unpickle ``step``'s ``.metadata`` (trusted here: the test wrote it), let ``change``
    alter it, pickle it back and recompute ``checksums.json`` as whoever writes the folder
    can. Returns the ``.metadata`` path."""
    path = step / ".metadata"
    with open(path, "rb") as f:
        index = pickle.load(f)
    change(index)
    path.write_bytes(pickle.dumps(index))
    # The sums as a save writes them (fitdp.executor.sharded_io.SUMS): anyone can.
    files = {p.name: sharded_io.file_sum(p) for p in step.iterdir() if p.name != SUMS}
    body = {"files": files, "crc32": zlib.crc32(json.dumps(files, sort_keys=True).encode())}
    (step / SUMS).write_text(json.dumps(body))
    assert sharded_io.damaged_file(step) is None  # the crafted file passes the seal
    return path


def crafted(tmp_path: Path, marker: Path, name: str = "c.ckpt") -> tuple[Path, Path]:
    """A sharded checkpoint whose ``.metadata`` runs code when unpickled; (folder, file)."""
    folder = tmp_path / name
    step = saved(folder)
    return folder, rewrite_index(step, lambda index: setattr(index, "version",
                                                             RunsCode(marker)))


def test_a_crafted_metadata_with_recomputed_checksums_runs_no_code_on_load_or_resume(
        tmp_path):
    """Was: DCP's pickle.load ran the command during model.load(folder) and
    fit(resume=folder), which then failed with a raw AssertionError."""
    marker = tmp_path / "marker"
    folder, metadata = crafted(tmp_path, marker)
    assert_refused_unchanged(folder, metadata)  # load(), then fit(resume=): both refused
    with pytest.raises(fitdp.CheckpointError, match=re.escape(str(metadata))):
        load_sharded(folder)
    assert not marker.exists()


def test_a_crafted_sharded_backup_runs_no_code_and_the_previous_backup_serves(tmp_path):
    """BackupAndRestore(double_checkpoint=True) checks the latest backup's index too: a
    crafted one is set aside with a warning naming it, and fit resumes from the previous
    backup; without a previous one, fit refuses it. No code runs either way."""
    marker = tmp_path / "marker"
    backup = BackupAndRestore(tmp_path / "b", double_checkpoint=True)
    m = model()
    fit(m, 1)
    m.save(backup.previous_path, sharded=True)  # step 6
    _, metadata = crafted(tmp_path / "b", marker, name=BackupAndRestore.FILENAME)
    resumed = model(seed=1)
    with pytest.warns(UserWarning, match=re.escape(str(metadata))):
        fit(resumed, 2, callbacks=[BackupAndRestore(tmp_path / "b", double_checkpoint=True)])
    assert resumed.history.params["resumed"]["step"] == 6
    _, metadata = crafted(tmp_path / "c", marker, name=BackupAndRestore.FILENAME)
    with pytest.raises(fitdp.CheckpointError, match=re.escape(str(metadata))):
        fit(model(seed=1), 2, callbacks=[BackupAndRestore(tmp_path / "c")])
    assert not marker.exists()


def test_an_index_entry_read_as_a_pickled_object_is_refused(tmp_path):
    """DCP loads a BytesStorageMetadata entry with torch.load(weights_only=False): an index
    of only DCP's own types could still run the shard bytes' pickle through it."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    folder = tmp_path / "c.ckpt"

    def as_bytes(index) -> None:
        index.state_dict_metadata["module/0.weight"] = BytesStorageMetadata()

    metadata = rewrite_index(saved(folder), as_bytes)
    refusal = re.escape(str(metadata)) + ".*BytesStorageMetadata"
    with pytest.raises(fitdp.CheckpointError, match=refusal):
        load_sharded(folder)


def test_an_index_pointing_outside_the_step_folder_is_refused(tmp_path):
    """A storage entry's file name is joined to the folder by DCP: '../x' would read a file
    the checksums do not cover."""
    folder = tmp_path / "c.ckpt"

    def elsewhere(index) -> None:
        for info in index.storage_data.values():
            info.relative_path = "../elsewhere.distcp"

    metadata = rewrite_index(saved(folder), elsewhere)
    with pytest.raises(fitdp.CheckpointError, match=re.escape(str(metadata))):
        load_sharded(folder)


@pytest.mark.parametrize("name", ["__1_0.distcp", "stray.bin"])
def test_a_file_the_checksums_do_not_list_is_refused_naming_it(tmp_path, name):
    """Was: a sealed step folder with a copied shard or a stray file loaded without a word;
    the checksums list the folder's files exactly."""
    step = saved(tmp_path / "c.ckpt")
    (step / name).write_bytes((step / "__0_0.distcp").read_bytes())
    assert_refused_unchanged(tmp_path / "c.ckpt", step / name)


def test_a_killed_first_sharded_save_is_a_checkpoint_error(tmp_path):
    """Was a ValueError (a bad argument): a folder of step folders without LATEST is what a
    first save that never finished leaves, a broken checkpoint."""
    step = saved(tmp_path / "c.ckpt")
    (step.parent / "LATEST").unlink()
    (step / "checksums.json").unlink()  # as when the save was killed before it
    assert_refused_unchanged(tmp_path / "c.ckpt", tmp_path / "c.ckpt")


@pytest.mark.parametrize("data", [b"\xff\xfe step-6", b"../../etc", b""])
def test_a_damaged_latest_is_a_checkpoint_error_naming_it(tmp_path, data):
    """Was UnicodeDecodeError for non-UTF-8 bytes; a path in LATEST led the load out of the
    folder. A later save into the folder replaces it."""
    step = saved(tmp_path / "c.ckpt")
    (step.parent / "LATEST").write_bytes(data)
    assert_refused_unchanged(tmp_path / "c.ckpt", step.parent / "LATEST")
    m = model()
    fit(m, 1)
    m.save(tmp_path / "c.ckpt", sharded=True)
    assert load_sharded(tmp_path / "c.ckpt")["run"]["global_step"] == 6


def big_model() -> fitdp.Model:
    """About 160 KB of weights: more than the file size limit below."""
    torch.manual_seed(0)
    m = fitdp.Model(nn.Sequential(nn.Linear(6, 4096), nn.Tanh(), nn.Linear(4096, 3)))
    m.compile(optimizer="adamw", lr=0.05, loss="cross_entropy")
    return m


@pytest.mark.parametrize("sharded", [False, True])
def test_a_failed_write_is_an_os_error_naming_the_path_and_errno(tmp_path, sharded):
    """Was torch's "[enforce fail at inline_container.cc] unexpected pos", with no path and
    no errno. The kernel refuses the write here (a file size limit: EFBIG), through the same
    code as a full disk (ENOSPC)."""
    m = big_model()
    path = tmp_path / "c.ckpt"
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills us
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, old_limit[1]))
    try:
        with pytest.raises(OSError) as caught:
            m.save(path, sharded=sharded)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert caught.value.errno == errno.EFBIG
    assert str(path) in str(caught.value)
    assert not path.exists() or not (path / "LATEST").exists()  # nothing claims to be whole


def test_a_full_disk_is_enospc_naming_the_file(tmp_path, monkeypatch):
    """The file a checkpoint is written through fails as a full disk does, after 4 KB: the
    error is errno ENOSPC naming the checkpoint (torch.save's own error named neither)."""
    real_fdopen = os.fdopen

    class FullDisk:
        def __init__(self, f) -> None:
            self.f, self.left = f, 4096

        def write(self, data) -> int:
            self.left -= memoryview(data).nbytes
            if self.left < 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.f.write(data)

        def __getattr__(self, name: str):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.f.close()

    monkeypatch.setattr(os, "fdopen", lambda *a, **k: FullDisk(real_fdopen(*a, **k)))
    m = big_model()
    with pytest.raises(OSError) as caught:
        m.save(tmp_path / "c.ckpt")
    assert caught.value.errno == errno.ENOSPC
    assert str(tmp_path / "c.ckpt") in str(caught.value)
    assert os.listdir(tmp_path) == []  # the temporary file is gone too


def test_the_index_reader_admits_what_dcp_writes(tmp_path):
    """Every type a DCP index of fitdp's shards holds (dtypes beyond float32, 0-d tensors,
    a transposed tensor) passes the restricted unpickler, and the load is exact."""
    import torch.distributed.checkpoint as dcp

    state = {"a": torch.randn(3, 4).t(), "b": torch.arange(5, dtype=torch.int32),
             "c": torch.tensor(2.5, dtype=torch.bfloat16), "d": torch.ones(2, dtype=torch.bool)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(tmp_path / "s"), no_dist=True)
    sharded_io.read_metadata(tmp_path / "s")
    (tmp_path / "LATEST").write_text("step-0")
    (tmp_path / "s").rename(tmp_path / "step-0")
    into = {k: torch.empty_like(v) for k, v in state.items()}
    assert sharded_io.load(tmp_path, into) == 0
    assert all(torch.equal(into[k], v) for k, v in state.items())
