"""Tests for fitdp.saving.checkpoint: atomic saves, verified loads, RNG state, temp-file cleanup."""

from __future__ import annotations

import io
import os
import pickle
import random
import re
import struct
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from ckpt_support import assert_same, temp_files

from fitdp.saving import checkpoint, seal
from fitdp.saving.checkpoint import (
    HEADER_KEY,
    CheckpointError,
    capture_rng_state,
    list_checkpoints,
    load_checkpoint,
    remove_stale_temp_files,
    restore_rng_state,
    save_checkpoint,
)


def small_state() -> dict[str, Any]:
    """A few KB of state with several records, used for the corruption tests."""
    return {
        "weights": torch.linspace(-1, 1, 300),
        "ids": torch.arange(50, dtype=torch.int64),
        "meta": {"epoch": 3, "name": "run-1"},
    }


def write_sealed(path: Path, obj: Any) -> None:
    """A torch.save file of ``obj`` with a valid fitdp seal: passes integrity, not content."""
    with open(path, "w+b") as f:
        torch.save(obj, f)
        seal.seal(f)


# --- round trip and input validation -------------------------------------------------------


def test_round_trip_nested_state(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    state = {
        "model": model.state_dict(),  # an OrderedDict
        "optimizer": optimizer.state_dict(),  # int keys, tuples (betas), None, bools
        "tensors": {
            str(dtype): torch.arange(6).reshape(2, 3).to(dtype)
            for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                          torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool,
                          torch.complex64)
        },
        "scalar_tensor": torch.tensor(2.5),
        "empty_tensor": torch.empty(0, 7),
        "non_contiguous": torch.arange(12.0).reshape(3, 4).t(),
        "epoch": 7,
        "loss": 0.125,
        "inf": float("inf"),
        "flag": False,
        "note": "ünïcode ✓",
        "nothing": None,
        "history": [1, 2.5, "x", None, (True, [3, {"deep": torch.ones(2)}])],
        "pair": (1, "a"),
    }
    path = tmp_path / "sub dir ü" / "run.ckpt"  # missing parent, non-ASCII name
    keys_before = list(state)

    save_checkpoint(path, state)
    loaded = load_checkpoint(path)

    assert list(state) == keys_before, "the header must not be added to the caller's dict"
    assert_same(loaded, state)
    fresh = torch.optim.Adam(model.parameters(), lr=1e-3)
    fresh.load_state_dict(loaded["optimizer"])
    # The file is an ordinary torch file too (API: "loads with torch.load(weights_only=True)").
    raw = torch.load(path, weights_only=True)
    assert raw[HEADER_KEY] == {"format": checkpoint.FORMAT_VERSION}
    assert temp_files(path.parent) == []


def test_save_overwrites_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "a.ckpt"
    save_checkpoint(path, {"step": 1, "w": torch.zeros(3)})
    save_checkpoint(str(path), {"step": 2, "w": torch.ones(3)})
    assert_same(load_checkpoint(str(path)), {"step": 2, "w": torch.ones(3)})
    assert os.listdir(tmp_path) == ["a.ckpt"]


@pytest.mark.parametrize(
    ("state", "where", "found"),
    [
        ({"opt": {"m": np.zeros(3)}}, "state['opt']['m']", "numpy.ndarray"),
        ({"hist": [1, object()]}, "state['hist'][1]", "builtins.object"),
        ({"seed": np.int64(3)}, "state['seed']", "numpy.int64"),
        ({"blob": b"raw"}, "state['blob']", "builtins.bytes"),
        ({"set": {1, 2}}, "state['set']", "builtins.set"),
        ({"dtype": torch.float32}, "state['dtype']", "torch.dtype"),
    ],
)
def test_save_rejects_unsupported_values(
    tmp_path: Path, state: dict[str, Any], where: str, found: str
) -> None:
    path = tmp_path / "bad.ckpt"
    with pytest.raises(TypeError) as info:
        save_checkpoint(path, state)
    assert where in str(info.value) and found in str(info.value)
    assert os.listdir(tmp_path) == [], "nothing may be written for rejected state"


def test_save_rejects_bad_keys_cycles_and_reserved_key(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"state\['a'\].*\(1, 2\)"):
        save_checkpoint(tmp_path / "k.ckpt", {"a": {(1, 2): 0}})
    loop: list[Any] = [1]
    loop.append(loop)
    with pytest.raises(ValueError, match=r"state\['loop'\]\[1\].*cycle"):
        save_checkpoint(tmp_path / "c.ckpt", {"loop": loop})
    with pytest.raises(ValueError, match="reserved"):
        save_checkpoint(tmp_path / "r.ckpt", {HEADER_KEY: 1})
    with pytest.raises(TypeError, match="expected a dict"):
        save_checkpoint(tmp_path / "l.ckpt", [1, 2])  # type: ignore[arg-type]
    shared = torch.ones(2)  # the same object twice is fine: only cycles are refused
    save_checkpoint(tmp_path / "ok.ckpt", {"a": [shared, shared], "b": shared})
    assert os.listdir(tmp_path) == ["ok.ckpt"]


# --- damaged, foreign and malicious files ----------------------------------------------------


def record_span(data: bytes, name_suffix: str) -> tuple[int, int]:
    """(start, size) of the stored zip record whose name ends with ``name_suffix``."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(name_suffix))
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
    return info.header_offset + 30 + name_len + extra_len, info.compress_size


def test_torch_load_alone_misses_flipped_tensor_bytes(tmp_path: Path) -> None:
    """Pins why the seal exists: torch.load ignores record CRCs and loads flipped data."""
    path = tmp_path / "plain.pt"
    torch.save({"w": torch.zeros(100)}, path)
    data = bytearray(path.read_bytes())
    start, _ = record_span(bytes(data), "data/0")
    data[start + 40] ^= 0xFF
    path.write_bytes(bytes(data))
    assert not torch.equal(torch.load(path, weights_only=True)["w"], torch.zeros(100))


@pytest.mark.parametrize(
    "region", ["tensor data", "tensor data end", "pickle", "local header", "central directory",
               "end record", "seal"]
)
@pytest.mark.parametrize("mask", [0x01, 0x80, 0xFF])
def test_flipped_bytes_raise(tmp_path: Path, region: str, mask: int) -> None:
    path = tmp_path / "flip.ckpt"
    save_checkpoint(path, small_state())
    data = bytearray(path.read_bytes())
    pickle_start, pickle_size = record_span(bytes(data), "data.pkl")
    tensor_start, tensor_size = record_span(bytes(data), "data/0")
    central = bytes(data).rindex(b"PK\x01\x02")
    position = {
        "tensor data": tensor_start + tensor_size // 2,
        "tensor data end": tensor_start + tensor_size - 1,
        "pickle": pickle_start + pickle_size // 2,
        "local header": 14,  # CRC field of the first record
        "central directory": central + 10,
        "end record": len(data) - seal._SEAL_LEN - 12,
        "seal": len(data) - 5,
    }[region]
    data[position] ^= mask
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=re.escape(str(path))):
        load_checkpoint(path)


def test_every_single_bit_flip_and_truncation_raises(tmp_path: Path) -> None:
    path = tmp_path / "tiny.ckpt"
    save_checkpoint(path, {"w": torch.arange(8.0), "n": 1})
    good = path.read_bytes()
    damaged = tmp_path / "damaged.ckpt"
    rng = random.Random(0)
    for position in range(len(good)):
        data = bytearray(good)
        data[position] ^= 1 << rng.randrange(8)
        damaged.write_bytes(bytes(data))
        with pytest.raises(CheckpointError, match=re.escape(str(damaged))):
            load_checkpoint(damaged)
    for length in range(len(good)):
        damaged.write_bytes(good[:length])
        with pytest.raises(CheckpointError, match=re.escape(str(damaged))):
            load_checkpoint(damaged)


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("empty", "empty"),
        ("text", "no fitdp seal"),
        ("random bytes", "no fitdp seal"),
        ("plain torch.save", "no fitdp seal"),
        ("sealed, no header", "foreign"),
        ("sealed, not a dict", "foreign"),
        ("sealed, newer format", "format 99"),
    ],
)
def test_foreign_and_empty_files_raise(tmp_path: Path, kind: str, reason: str) -> None:
    path = tmp_path / f"{kind.replace(' ', '_').replace(',', '')}.ckpt"
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "text":
        path.write_text("epoch=3\nloss=0.1\n" * 20)
    elif kind == "random bytes":
        path.write_bytes(np.random.default_rng(0).bytes(5000))
    elif kind == "plain torch.save":
        torch.save({"a": 1}, path)
    elif kind == "sealed, no header":
        write_sealed(path, {"a": 1})
    elif kind == "sealed, not a dict":
        write_sealed(path, torch.ones(3))
    else:
        write_sealed(path, {"a": 1, HEADER_KEY: {"format": 99}})
    with pytest.raises(CheckpointError, match=re.escape(str(path))) as info:
        load_checkpoint(path)
    assert reason in str(info.value)


def test_missing_file_raises_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "nope.ckpt")


class OpensFile:
    """Unpickling this creates the marker file: the stand-in for arbitrary code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


class RunsShell:
    """Unpickling this runs a shell command that creates the marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch '{self.marker}'",))


@pytest.mark.parametrize("payload", [OpensFile, RunsShell])
@pytest.mark.parametrize("writer", ["pickle.dump", "torch.save", "torch.save + valid seal"])
def test_malicious_pickle_is_refused_without_running(
    tmp_path: Path, payload: type, writer: str
) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.ckpt"
    evil = {"weights": torch.ones(2), "x": payload(str(marker)), HEADER_KEY: {"format": 1}}
    if writer == "pickle.dump":
        with open(path, "wb") as f:
            pickle.dump(evil, f)
    elif writer == "torch.save":
        torch.save(evil, path)
    else:  # passes every integrity check, so only weights_only stands in the way
        write_sealed(path, evil)

    with pytest.raises(CheckpointError, match=re.escape(str(path))):
        load_checkpoint(path)
    assert not marker.exists()
    # Control: the payload is live, full unpickling does run it.
    if writer == "pickle.dump":
        with open(path, "rb") as f:
            pickle.load(f)
    else:
        torch.load(path, weights_only=False)
    assert marker.exists()


# --- folder helpers and RNG state ------------------------------------------------------------


def test_list_checkpoints_newest_first_without_temp_files(tmp_path: Path) -> None:
    for index, name in enumerate(["b.ckpt", "a.ckpt", "c.ckpt", ".c.ckpt.tmp-1-0a1b2c3d", "x.txt"]):
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, ns=(0, (1_000 + [30, 20, 10, 40, 50][index]) * 10**9))
    (tmp_path / "dir.ckpt").mkdir()
    assert list_checkpoints(tmp_path) == [str(tmp_path / n) for n in ["b.ckpt", "a.ckpt", "c.ckpt"]]
    assert list_checkpoints(tmp_path, "*.txt") == [str(tmp_path / "x.txt")]
    assert list_checkpoints(tmp_path / "missing") == []


def test_remove_stale_temp_files_keeps_live_writers(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f".model.ckpt.tmp-{dead.pid}-0a1b2c3d"
    live = tmp_path / f".model.ckpt.tmp-{os.getpid()}-0a1b2c3d"
    keep = [tmp_path / "model.ckpt", tmp_path / ".hidden", tmp_path / "notes.tmp-1-0a1b2c3d",
            tmp_path / ".notes.tmp-draft"]  # look alike, but not save_checkpoint names
    for file in [stale, live, *keep]:
        file.write_bytes(b"x")
    assert remove_stale_temp_files(tmp_path) == [str(stale)]
    assert sorted(os.listdir(tmp_path)) == sorted(p.name for p in [live, *keep])
    assert remove_stale_temp_files(tmp_path / "missing") == []


def draw_all() -> tuple[torch.Tensor, list[float], np.ndarray]:
    """Next numbers from every RNG that fitdp restores, Gaussian caches included."""
    return (
        torch.cat([torch.rand(4), torch.randn(3)]),
        [random.random(), random.gauss(0, 1), random.gauss(0, 1)],
        np.concatenate([np.random.rand(3), np.random.randn(3)]),
    )


def test_rng_state_round_trip_through_a_checkpoint(tmp_path: Path) -> None:
    random.gauss(0, 1)  # leave a cached second Gaussian in `random` and in numpy
    np.random.randn(1)
    path = tmp_path / "rng.ckpt"
    save_checkpoint(path, {"rng": capture_rng_state()})
    expected = draw_all()
    draw_all()  # move every generator on
    restore_rng_state(load_checkpoint(path)["rng"])
    actual = draw_all()
    assert torch.equal(actual[0], expected[0])
    assert actual[1] == expected[1]
    np.testing.assert_array_equal(actual[2], expected[2])
