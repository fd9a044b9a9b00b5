"""Tests for fitdp.saving.async_writer.AsyncCheckpointWriter (issue 12.2). Its SIGKILL test is
test_checkpoint_io.py::test_sigkill_at_random_moments_leaves_a_loadable_checkpoint[async]."""

from __future__ import annotations

import errno
import os
import sys
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_support import assert_same, temp_files

from fitdp.saving import async_writer as async_checkpoint
from fitdp.saving.async_writer import AsyncCheckpointWriter
from fitdp.saving.checkpoint import load_checkpoint, save_checkpoint


def trained_state() -> dict[str, Any]:
    """Module and Adam state after a step, plus the shapes torch.save treats specially."""
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.Adam(net.parameters())
    net(torch.randn(5, 4)).sum().backward()
    opt.step()
    base = torch.arange(12.0).reshape(3, 4)
    return {
        "module": net.state_dict(),  # an OrderedDict with _metadata
        "optimizer": opt.state_dict(),  # int keys, tuples, scalar tensors
        "param": torch.nn.Parameter(torch.ones(2)),
        "tied": [base, base],  # one object twice
        "view": base[1:, ::2],  # shares base's storage, offset and strides of its own
        "transposed": base.t(),
        "empty": torch.empty(0, 3),
        "ints": torch.arange(5, dtype=torch.int16),
        "epoch": 3,
        "note": "x",
    }


class Gate:
    """Holds the writer thread before it writes, until ``open()``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.event = threading.Event()
        self.started = threading.Event()
        real = async_checkpoint.write_checkpoint

        def gated(path: str, state: dict[str, Any]) -> None:
            self.started.set()
            assert self.event.wait(20), "gate never opened"
            real(path, state)

        monkeypatch.setattr(async_checkpoint, "write_checkpoint", gated)

    def open(self) -> None:
        self.event.set()


def test_file_equals_the_synchronous_save(tmp_path: Path) -> None:
    state = trained_state()
    save_checkpoint(tmp_path / "sync.ckpt", state)
    with AsyncCheckpointWriter() as writer:
        writer.submit(tmp_path / "async.ckpt", state)
    sync, asyn = load_checkpoint(tmp_path / "sync.ckpt"), load_checkpoint(tmp_path / "async.ckpt")
    assert_same(asyn, sync)
    assert asyn["module"]._metadata == sync["module"]._metadata
    assert type(asyn["param"]) is torch.nn.Parameter
    assert asyn["tied"][0] is asyn["tied"][1]
    view, base = asyn["view"], asyn["tied"][0]
    assert view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    assert (view.storage_offset(), view.stride()) == (4, (4, 2))
    assert sorted(os.listdir(tmp_path)) == ["async.ckpt", "sync.ckpt"]


def test_submit_snapshots_so_later_changes_are_not_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = Gate(monkeypatch)
    weights, history = torch.zeros(1000), [1, 2]
    writer = AsyncCheckpointWriter()
    writer.submit(tmp_path / "a.ckpt", {"w": weights, "history": history})
    assert gate.started.wait(20)
    weights.add_(1.0)  # training goes on while the file is not written yet
    history.append(3)
    gate.open()
    writer.wait()
    saved = load_checkpoint(tmp_path / "a.ckpt")
    assert torch.equal(saved["w"], torch.zeros(1000)) and saved["history"] == [1, 2]


def test_host_buffers_are_reused_when_sizes_match(tmp_path: Path) -> None:
    """A save costs a copy into the previous save's host buffers, not an allocation."""
    writer = AsyncCheckpointWriter()
    state = {"a": torch.randn(100, 10), "b": {"c": torch.randn(7)}}
    writer.submit(tmp_path / "1.ckpt", state)
    first = [b.data_ptr() for b in writer._snapshot._buffers]
    writer.submit(tmp_path / "2.ckpt", {"a": torch.randn(100, 10), "b": {"c": torch.randn(7)}})
    assert [b.data_ptr() for b in writer._snapshot._buffers] == first
    writer.submit(tmp_path / "3.ckpt", {"a": torch.randn(100, 11), "b": {"c": torch.randn(7)}})
    assert [b.data_ptr() for b in writer._snapshot._buffers][1:] == first[1:]
    writer.close()
    assert torch.equal(load_checkpoint(tmp_path / "1.ckpt")["a"], state["a"])


def test_second_submit_waits_for_the_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate(monkeypatch)
    writer = AsyncCheckpointWriter()
    writer.submit(tmp_path / "a.ckpt", {"n": 1})
    assert gate.started.wait(20) and writer.in_flight
    second = threading.Thread(target=writer.submit, args=(tmp_path / "a.ckpt", {"n": 2}))
    second.start()
    second.join(0.3)
    assert second.is_alive(), "a second save started while the first was in flight"
    gate.open()
    second.join(20)
    writer.wait()
    assert not writer.in_flight and load_checkpoint(tmp_path / "a.ckpt") == {"n": 2}


def test_wait_returns_when_the_file_is_in_place(tmp_path: Path) -> None:
    writer = AsyncCheckpointWriter()
    writer.submit(tmp_path / "sub" / "a.ckpt", {"w": torch.ones(100_000)})
    writer.wait()
    assert not writer.in_flight
    assert os.listdir(tmp_path / "sub") == ["a.ckpt"]
    assert torch.equal(load_checkpoint(tmp_path / "sub" / "a.ckpt")["w"], torch.ones(100_000))


def test_failed_save_raises_at_next_submit_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def disk_full(path: str, state: dict[str, Any]) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    writer = AsyncCheckpointWriter()
    monkeypatch.setattr(async_checkpoint, "write_checkpoint", disk_full)
    writer.submit(tmp_path / "a.ckpt", {"n": 1})
    monkeypatch.undo()
    with pytest.raises(OSError) as info:
        writer.submit(tmp_path / "a.ckpt", {"n": 2})  # reports the failure, saves nothing
    assert info.value.errno == errno.ENOSPC
    if sys.version_info >= (3, 11):  # exception notes
        assert any("background checkpoint save" in n for n in info.value.__notes__)
    assert not writer.in_flight and os.listdir(tmp_path) == []
    writer.submit(tmp_path / "a.ckpt", {"n": 3})  # reported once: the writer goes on
    writer.close()
    assert load_checkpoint(tmp_path / "a.ckpt") == {"n": 3}


def test_failed_save_raises_at_wait_and_leaves_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "a.ckpt"
    save_checkpoint(path, {"n": 1})

    def no_fsync(fd: int) -> None:
        raise OSError(errno.EIO, "I/O error")

    writer = AsyncCheckpointWriter()
    monkeypatch.setattr(os, "fsync", no_fsync)
    writer.submit(path, {"n": 2})
    with pytest.raises(OSError, match="I/O error"):
        writer.wait()
    monkeypatch.undo()
    writer.wait()  # reported once
    assert load_checkpoint(path) == {"n": 1} and temp_files(tmp_path) == []


def test_on_durable_runs_after_the_rename_and_its_errors_fail_the_save(tmp_path: Path) -> None:
    seen: list[tuple[str, Any]] = []
    writer = AsyncCheckpointWriter()
    writer.submit(tmp_path / "b.ckpt", {"n": 2},
                  on_durable=lambda p: seen.append((p, load_checkpoint(p))))
    writer.wait()
    assert seen == [(str(tmp_path / "b.ckpt"), {"n": 2})]

    def prune(path: str) -> None:
        raise PermissionError(errno.EACCES, "cannot delete the old checkpoint")

    writer.submit(tmp_path / "c.ckpt", {"n": 3}, on_durable=prune)
    with pytest.raises(PermissionError, match="old checkpoint"):
        writer.close()
    assert load_checkpoint(tmp_path / "c.ckpt") == {"n": 3}  # the file itself is safe


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((5, {"a": 1}), TypeError, "path: got 5"),
        (("x.ckpt", {"a": object()}), TypeError, r"state\['a'\]"),
        (("x.ckpt", [1]), TypeError, "expected a dict"),
        (("x.ckpt", {"a": 1}, "prune"), TypeError, "on_durable: got 'prune'"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_submitted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: tuple[Any, ...],
    error: type[Exception], match: str
) -> None:
    monkeypatch.chdir(tmp_path)
    writer = AsyncCheckpointWriter()
    with pytest.raises(error, match=match):
        writer.submit(*args)
    assert not writer.in_flight and os.listdir(tmp_path) == []


def test_close_waits_frees_and_refuses_new_saves(tmp_path: Path) -> None:
    with AsyncCheckpointWriter() as writer:
        writer.submit(tmp_path / "a.ckpt", {"w": torch.ones(10)})
    assert os.listdir(tmp_path) == ["a.ckpt"] and writer._snapshot._buffers == []
    writer.close()  # idempotent
    with pytest.raises(ValueError, match="closed writer.*create a new AsyncCheckpointWriter"):
        writer.submit(tmp_path / "b.ckpt", {"a": 1})


def test_relative_path_is_resolved_at_submit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = Gate(monkeypatch)
    (tmp_path / "run").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    writer = AsyncCheckpointWriter()
    writer.submit("a.ckpt", OrderedDict(n=1))
    os.chdir(tmp_path / "elsewhere")
    gate.open()
    writer.wait()
    assert os.listdir(tmp_path / "run") == ["a.ckpt"] and os.listdir(tmp_path / "elsewhere") == []


def test_writer_thread_runs_at_lower_cpu_priority(tmp_path: Path) -> None:
    """Where every core is busy, the background save yields to training. On Linux the nice
    value belongs to the thread, so the writer lowers its own; elsewhere a thread id would name
    a process, so the writer leaves the priority alone."""
    linux = sys.platform.startswith("linux")

    def priority() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id() if linux else 0)

    mine = priority()
    seen: list[int] = []
    with AsyncCheckpointWriter() as writer:
        writer.submit(tmp_path / "a.ckpt", {"n": 1}, on_durable=lambda p: seen.append(priority()))
    assert seen == [min(19, mine + 10) if linux else mine]
    assert priority() == mine


def test_deferred_tensors_are_copied_on_the_writer_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """submit(defer=...) returns before copying those tensors; the file is still the state at
    submit, and ``copied`` says when they may change (issue 20.4: the copy stalled training)."""
    held, real = threading.Event(), async_checkpoint._copy
    monkeypatch.setattr(async_checkpoint, "_copy", lambda late: (held.wait(20), real(late)))
    state = trained_state()
    save_checkpoint(tmp_path / "sync.ckpt", state)
    weights, buffers = state["module"]["0.weight"], state["module"]["1.running_mean"]
    writer = AsyncCheckpointWriter()
    writer.submit(tmp_path / "async.ckpt", state, defer=[weights, state["tied"][0]])
    assert not writer.copied.is_set()
    buffers.add_(1.0)  # not deferred: copied inside submit
    held.set()
    assert writer.copied.wait(20)
    weights.add_(1.0)
    state["tied"][0].add_(1.0)  # and its views, which share the storage
    writer.close()
    assert_same(load_checkpoint(tmp_path / "async.ckpt"), load_checkpoint(tmp_path / "sync.ckpt"))


def test_a_failed_deferred_copy_releases_the_fence_and_fails_the_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(late: Any) -> None:
        raise MemoryError("no room")

    monkeypatch.setattr(async_checkpoint, "_copy", broken)
    weights = torch.ones(10)
    writer = AsyncCheckpointWriter()
    writer.submit(tmp_path / "a.ckpt", {"w": weights}, defer=[weights])
    assert writer.copied.wait(20)
    with pytest.raises(MemoryError, match="no room"):
        writer.wait()
    assert not (tmp_path / "a.ckpt").exists()


def test_a_deferred_wrapper_subclass_without_storage_is_copied_in_submit(tmp_path: Path) -> None:
    """defer=[a DTensor-like wrapper] used to raise on its storage's data pointer."""
    from torch.testing._internal.two_tensor import TwoTensor

    shard = TwoTensor(torch.ones(3), torch.ones(3))
    with AsyncCheckpointWriter() as writer:
        writer.submit(tmp_path / "a.ckpt", {"n": 1}, defer=[shard])
    assert load_checkpoint(tmp_path / "a.ckpt") == {"n": 1}
