"""fitdp computes the record CRC-32s of its files itself (zlib releases the GIL, torch's CRC
pass does not): the files must stay valid zips, and torch's global CRC switch unchanged."""

from __future__ import annotations

import threading
import zipfile
from pathlib import Path

import pytest
import torch

from fitdp.saving.checkpoint import load_checkpoint, save_checkpoint


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
