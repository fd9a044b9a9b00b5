"""Every record of a fitdp file carries its CRC-32 (torch.save's own, or fitdp's when the user
turned torch's CRC option off): the files must stay valid zips, and torch's process-wide CRC
option is the user's: fitdp reads it, never sets it."""

from __future__ import annotations

import io
import threading
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fitdp.saving.checkpoint import load_checkpoint, save_checkpoint
from fitdp.saving.seal import write_sealed


def state(seed: int) -> dict[str, torch.Tensor]:
    """Records below and above the size whose CRC is taken as torch writes it (64 KB)."""
    g = torch.Generator().manual_seed(seed)
    return {"small": torch.randn(10, generator=g), "large": torch.randn(100_000, generator=g),
            "exact": torch.randn(1 << 14, generator=g)}


def test_record_crcs_are_those_any_zip_reader_checks(tmp_path: Path) -> None:
    path = tmp_path / "a.ckpt"
    save_checkpoint(path, state(0))
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None  # reads every record and checks its CRC-32
        assert all(info.CRC for info in archive.infolist())


@pytest.mark.parametrize("was_on", [True, False])
def test_torch_crc_switch_is_left_as_found(tmp_path: Path, was_on: bool) -> None:
    torch.serialization.set_crc32_options(was_on)
    try:
        save_checkpoint(tmp_path / "a.ckpt", state(0))
        assert torch.serialization.get_crc32_options() is was_on
    finally:
        torch.serialization.set_crc32_options(True)
    with zipfile.ZipFile(tmp_path / "a.ckpt") as archive:
        assert archive.testzip() is None


def test_saves_in_several_threads_all_get_valid_crcs(tmp_path: Path) -> None:
    errors: list[BaseException] = []

    def saver(index: int) -> None:
        try:
            for round_ in range(4):
                save_checkpoint(tmp_path / f"{index}-{round_}.ckpt", state(index * 10 + round_))
        except BaseException as exc:  # noqa: B036  (reported by the test thread)
            errors.append(exc)

    threads = [threading.Thread(target=saver, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors and torch.serialization.get_crc32_options()
    for index in range(3):
        for round_ in range(4):
            loaded = load_checkpoint(tmp_path / f"{index}-{round_}.ckpt")
            assert torch.equal(loaded["large"], state(index * 10 + round_)["large"])



def test_seal_switched_torch_crc_option_that_a_user_save_reads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: the seal switched torch's CRC option (process-wide before torch made config
    overrides thread-local) off while it saved, so a user's torch.save meanwhile wrote CRCs 0."""
    calls: list[bool] = []
    monkeypatch.setattr(torch.serialization, "set_crc32_options", calls.append)
    save_checkpoint(tmp_path / "a.ckpt", state(0))
    assert calls == []


def test_user_torch_save_on_another_thread_during_a_fitdp_save_keeps_its_crcs() -> None:
    """Regression: a user's torch.save on another thread during a fitdp save wrote CRCs 0."""
    user_files: list[io.BytesIO] = []

    class FileThatLetsTheUserSave(io.BytesIO):
        """fitdp's target file: its first write runs a user's torch.save on another thread."""

        def write(self, data: object) -> int:
            if not user_files:
                user_files.append(io.BytesIO())
                thread = threading.Thread(target=torch.save, args=(state(1), user_files[0]))
                thread.start()
                thread.join(60)
            return super().write(data)  # type: ignore[arg-type]

    target = FileThatLetsTheUserSave()
    write_sealed(target, state(0))
    # torch.save with its default option writes real CRC-32s, which zipfile checks on read.
    with zipfile.ZipFile(user_files[0]) as archive:
        assert archive.testzip() is None
        assert all(info.CRC for info in archive.infolist())
    with zipfile.ZipFile(target) as archive:
        assert archive.testzip() is None


def test_overlapping_saves_left_torch_crcs_off_in_the_thread_that_finished_first() -> None:
    """Regression: a fitdp save ending while another thread's was running left torch's CRC
    option off in its thread, so the user's next torch.save there wrote CRCs 0."""
    other_writing, first_done = threading.Event(), threading.Event()
    other: list[threading.Thread] = []

    class Gate(io.BytesIO):
        """Runs ``on_first_write`` before its first write."""

        def __init__(self, on_first_write: Callable[[], object]) -> None:
            super().__init__()
            self.on_first_write: Callable[[], object] | None = on_first_write

        def write(self, data: object) -> int:
            if self.on_first_write is not None:
                self.on_first_write, run = None, self.on_first_write
                run()
            return super().write(data)  # type: ignore[arg-type]

    def start_other() -> None:  # the other save is mid-way when this thread's ends
        def wait_for_first() -> None:
            other_writing.set()
            first_done.wait(60)
        other.append(threading.Thread(target=write_sealed, args=(Gate(wait_for_first), state(1))))
        other[0].start()
        other_writing.wait(60)

    write_sealed(Gate(start_other), state(0))
    first_done.set()
    other[0].join(60)
    user_file = io.BytesIO()
    torch.save(state(2), user_file)
    with zipfile.ZipFile(user_file) as archive:
        assert archive.testzip() is None
