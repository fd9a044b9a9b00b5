"""Tests for fitdp.saving.atomic: the one atomic writer of checkpoints, weights files and export."""

from __future__ import annotations

import doctest
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
from ckpt_support import SaverServer, temp_files

import fitdp
import fitdp.saving.async_writer
from fitdp.saving.atomic import TEMP_NAME, atomic_write, remove_stale_temp_files
from fitdp.saving.checkpoint import load_checkpoint, save_checkpoint
from fitdp.saving.export import export_module
from fitdp.saving.weights_file import save_weights_file


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_write_renames_a_complete_file_with_the_users_umask(tmp_path: Path) -> None:
    path = tmp_path / "a.bin"
    old_umask = os.umask(0o027)
    try:
        with atomic_write(path) as f:
            f.write(b"hello")
            (name,) = temp_files(tmp_path)  # while writing: only the temp file, pid inside
            match = TEMP_NAME.match(name)
            assert match and match["target"] == "a.bin" and int(match["pid"]) == os.getpid()
            assert not path.exists()
    finally:
        os.umask(old_umask)
    assert path.read_bytes() == b"hello" and os.listdir(tmp_path) == ["a.bin"]
    assert path.stat().st_mode & 0o777 == 0o640


@pytest.mark.parametrize("error", [ValueError("bad"), KeyboardInterrupt()])
def test_exception_in_the_block_removes_the_temp_and_keeps_the_target(
    tmp_path: Path, error: BaseException
) -> None:
    path = tmp_path / "a.bin"
    path.write_bytes(b"old")
    with pytest.raises(type(error)), atomic_write(path) as f:
        f.write(b"half of the new")
        raise error
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["a.bin"]


def test_cleans_dead_writers_temp_files_of_its_target_only(tmp_path: Path) -> None:
    dead = dead_pid()
    stale = tmp_path / f".a.bin.tmp-{dead}-0a1b2c3d"
    other_target = tmp_path / f".b.bin.tmp-{dead}-0a1b2c3d"
    live = tmp_path / f".a.bin.tmp-{os.getpid()}-0a1b2c3d"  # a writer in this process
    for file in (stale, other_target, live):
        file.write_bytes(b"x" * 100)
    with atomic_write(tmp_path / "a.bin") as f:
        f.write(b"new")
    assert sorted(os.listdir(tmp_path)) == sorted(["a.bin", other_target.name, live.name])
    assert remove_stale_temp_files(tmp_path, target="a.bin") == []
    assert remove_stale_temp_files(tmp_path) == [str(other_target)]


@pytest.mark.parametrize("save", ["save_checkpoint", "Model.save", "export", "weights"])
def test_every_writer_cleans_its_targets_stale_temp_files(tmp_path: Path, save: str) -> None:
    """Checkpoints, Model.save, export and weights files share the writer and its cleanup."""
    path = tmp_path / "target.bin"
    stale = tmp_path / f".target.bin.tmp-{dead_pid()}-0a1b2c3d"
    stale.write_bytes(b"x" * 1000)
    net = torch.nn.Linear(3, 2)
    if save == "save_checkpoint":
        save_checkpoint(path, {"w": net.weight})
    elif save == "Model.save":
        fitdp.Model(net).save(path)
    elif save == "export":
        export_module(net, path, torch.randn(4, 3))
    else:
        save_weights_file(path, net.state_dict())
    assert os.listdir(tmp_path) == ["target.bin"]


def test_twenty_sigkilled_saves_leave_no_temp_files_after_the_next_save(
    tmp_path: Path, saver_server: Callable[[Path, str], SaverServer]
) -> None:
    """Regression (10.14): 20 saves of one target SIGKILLed mid-write left 19 full-size temp
    files; each save now removes the temp files of dead writers of its target first."""
    folder = tmp_path / "ckpts"
    path = folder / "latest.ckpt"
    save_checkpoint(path, {"counter": 0, "weights": torch.zeros(1),
                           "nested": {"steps": [torch.zeros(1, dtype=torch.int64), 0]}})
    server = saver_server(path, "sync")
    killed_mid_write = 0
    for _ in range(20):
        saver = server.start()
        deadline = time.monotonic() + 10
        while not any(f".tmp-{saver}-" in name for name in os.listdir(folder)):
            assert time.monotonic() < deadline, "the saver never started writing"
        server.kill(saver)  # it was writing a moment ago: most kills land mid-write
        killed_mid_write += any(f".tmp-{saver}-" in name for name in os.listdir(folder))
        assert len(temp_files(folder)) <= 1, "a save left the temp files of dead writers"
    assert killed_mid_write >= 10, f"only {killed_mid_write} of 20 kills landed mid-write"

    save_checkpoint(path, {"counter": -1})
    assert os.listdir(folder) == ["latest.ckpt"]
    assert load_checkpoint(path) == {"counter": -1}


@pytest.mark.parametrize("module", [fitdp.saving.atomic, fitdp.saving.async_writer])
def test_docstring_examples_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: ModuleType
) -> None:
    monkeypatch.chdir(tmp_path)  # the examples write files
    result = doctest.testmod(module, extraglobs={"torch": torch})
    assert result.failed == 0 and result.attempted > 0
