"""Regression (10.13): a path that is a FIFO or a folder is refused with a ValueError naming
``path``, not waited on (opening a FIFO blocks until a writer comes, i.e. forever)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from fitdp.saving.async_writer import AsyncCheckpointWriter
from fitdp.saving.checkpoint import load_checkpoint, save_checkpoint
from fitdp.saving.export import export_module, load_predictor
from fitdp.saving.weights_file import load_weights_file, save_weights_file


def submit_async(path: Path) -> None:
    with AsyncCheckpointWriter() as writer:
        writer.submit(path, {"a": 1})


CALLS: dict[str, Callable[[Path], Any]] = {
    "save_checkpoint": lambda p: save_checkpoint(p, {"a": 1}),
    "load_checkpoint": load_checkpoint,
    "AsyncCheckpointWriter.submit": submit_async,
    "export_module": lambda p: export_module(torch.nn.Linear(2, 1), p, torch.randn(3, 2)),
    "load_predictor": load_predictor,
    "save_weights_file": lambda p: save_weights_file(p, {"w": torch.ones(2)}),
    "load_weights_file": load_weights_file,
}


def call_bounded(fn: Callable[[], Any], fifo: Path | None, seconds: float = 20) -> BaseException:
    """Run ``fn`` in a thread and return what it raised; fail if it is still running after
    ``seconds`` (and then unblock it: opening the FIFO read-write never blocks)."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: B036  (handed to the test thread)
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        if fifo is not None:
            os.close(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))
        pytest.fail(f"blocked for more than {seconds} s")
    assert raised, "no error raised"
    return raised[0]


@pytest.mark.parametrize("call", list(CALLS))
def test_fifo_path_is_refused_without_blocking(tmp_path: Path, call: str) -> None:
    fifo = tmp_path / "model.ckpt"
    os.mkfifo(fifo)
    error = call_bounded(lambda: CALLS[call](fifo), fifo)
    assert isinstance(error, ValueError), repr(error)
    assert str(error).startswith("path: got ") and "FIFO" in str(error), str(error)
    assert os.listdir(tmp_path) == ["model.ckpt"]


@pytest.mark.parametrize("call", list(CALLS))
def test_folder_path_is_refused(tmp_path: Path, call: str) -> None:
    folder = tmp_path / "model.ckpt"
    folder.mkdir()
    error = call_bounded(lambda: CALLS[call](folder), None)
    assert isinstance(error, ValueError), repr(error)
    assert str(error).startswith("path: got ") and "not a folder" in str(error), str(error)
    assert os.listdir(tmp_path) == ["model.ckpt"] and not os.listdir(folder)


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("kind", ["a FIFO", "a folder"])
def test_long_special_path_is_named_whole_with_its_kind(tmp_path: Path, call: str,
                                                       kind: str) -> None:
    """Issue 28 item 11: the refused path was cut at 60 characters, before the file name;
    the message now holds the whole path and says what is there."""
    deep = tmp_path / ("runs-" + "x" * 60) / "epoch-07"
    deep.mkdir(parents=True)
    path = deep / "model-final.ckpt"
    if kind == "a FIFO":
        os.mkfifo(path)
    else:
        path.mkdir()
    error = call_bounded(lambda: CALLS[call](path), path if kind == "a FIFO" else None)
    assert isinstance(error, ValueError), repr(error)
    assert str(error).startswith(f"path: got {str(path)!r}, {kind};"), str(error)


def test_a_device_path_is_named_as_a_device() -> None:
    """/dev/null (a character device) is refused as one, with its whole path."""
    error = call_bounded(lambda: load_checkpoint("/dev/null"), None)
    assert str(error).startswith("path: got '/dev/null', a device;"), str(error)
