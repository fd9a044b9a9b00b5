"""Checkpoint saves that fail, are interrupted or are SIGKILLed leave the previous file whole
and no temporary file (save_checkpoint and AsyncCheckpointWriter)."""

from __future__ import annotations

import errno
import os
import random
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_support import SaverServer, temp_files

from fitdp.saving.checkpoint import load_checkpoint, remove_stale_temp_files, save_checkpoint

TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)-[0-9a-f]{8}$")


# --- failures while saving -------------------------------------------------------------------


def _fail_fsync(fd: int) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def _fail_replace(src: str, dst: str) -> None:
    raise PermissionError(errno.EACCES, "Permission denied", dst)


def _fail_open(path: str, flags: int, mode: int = 0o777) -> int:
    raise PermissionError(errno.EACCES, "Permission denied", path)


def _half_written_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
    f.write(b"PK\x03\x04" + b"\0" * 4096)
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize(
    ("target", "attribute", "fake", "error"),
    [
        (os, "fsync", _fail_fsync, errno.ENOSPC),
        (os, "replace", _fail_replace, errno.EACCES),
        (os, "open", _fail_open, errno.EACCES),
        (torch, "save", _half_written_save, errno.ENOSPC),
    ],
    ids=["fsync ENOSPC", "replace EACCES", "open EACCES", "write ENOSPC mid-file"],
)
def test_failed_save_keeps_previous_file_and_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: Any, attribute: str, fake: Any,
    error: int
) -> None:
    path = tmp_path / "model.ckpt"
    save_checkpoint(path, {"step": 1, "w": torch.arange(1000.0)})
    before = path.read_bytes()

    monkeypatch.setattr(target, attribute, fake)
    with pytest.raises(OSError) as info:
        save_checkpoint(path, {"step": 2, "w": torch.zeros(1000)})
    monkeypatch.undo()

    assert info.value.errno == error
    assert path.read_bytes() == before
    assert temp_files(tmp_path) == []
    assert load_checkpoint(path)["step"] == 1


def test_interrupt_mid_save_cleans_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        f.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path / "m.ckpt", {"a": 1})
    assert os.listdir(tmp_path) == []


# --- SIGKILL at random moments ---------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigkill_at_random_moments_leaves_a_loadable_checkpoint(
    tmp_path: Path, saver_server: Callable[[Path, str], SaverServer], mode: str
) -> None:
    """With save_checkpoint and with AsyncCheckpointWriter: after every kill the latest
    complete file loads, is never older than the one before, and is never torn."""
    folder = tmp_path / "ckpts"
    path = folder / "latest.ckpt"
    save_checkpoint(path, {"counter": 0, "weights": torch.zeros(1),
                           "nested": {"steps": [torch.zeros(1, dtype=torch.int64), 0]}})
    server = saver_server(path, mode)
    rng = random.Random(1234)
    last_counter, kills_mid_write = 0, 0
    for i in range(90):
        if i >= 30 and last_counter > 0 and kills_mid_write > 0:
            break
        saver = server.start()
        # Kills from 20 ms to 200 ms in; on a loaded machine a save can take longer than
        # that, so each ten kills without a complete save widen the window by 200 ms.
        time.sleep(rng.uniform(0.02, 0.2 * (1 + (i // 10 if last_counter == 0 else 0))))
        server.kill(saver)

        leftovers = temp_files(folder)
        kills_mid_write += bool(leftovers)
        for name in leftovers:
            match = TEMP_NAME.match(name)
            assert match and match["name"] == path.name, name
        state = load_checkpoint(path)
        counter = state["counter"]
        assert counter >= last_counter, "a newer checkpoint was lost"
        last_counter = counter
        steps, step_counter = state["nested"]["steps"]
        assert bool((state["weights"] == counter).all()), "torn write: mixed counters"
        assert bool((steps == counter).all()) and step_counter == counter
        assert sorted(remove_stale_temp_files(folder)) == sorted(
            str(folder / name) for name in leftovers)
        assert os.listdir(folder) == [path.name]
    assert last_counter > 0, "the saver never completed a save"
    assert kills_mid_write > 0, "no kill landed inside a save; the test proved nothing"
