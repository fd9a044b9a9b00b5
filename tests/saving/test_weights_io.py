"""Tests for fitdp.saving.weights_file (issue 13.2): safetensors and sealed fitdp weights files."""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from fitdp.saving.checkpoint import CheckpointError, save_checkpoint
from fitdp.saving.weights_file import load_weights_file, save_weights_file

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool)


def weights() -> dict[str, torch.Tensor]:
    """Every common dtype, a 0-dim, an empty and a non-contiguous tensor."""
    g = torch.Generator().manual_seed(0)
    out = {f"t.{str(d).removeprefix('torch.')}": (torch.randn(3, 5, generator=g) * 50).to(d)
           for d in DTYPES}
    out["scalar"] = torch.tensor(2.5)
    out["empty"] = torch.empty(0, 4)
    out["transposed"] = torch.randn(4, 6, generator=g).t()
    out["special"] = torch.tensor([float("nan"), -0.0, float("inf")])
    return out


def tied_module() -> torch.nn.Module:
    """An embedding whose weight is also the output layer's (a tied language model head)."""
    net = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
    net[1].weight = net[0].weight
    return net


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_bit_exact(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Same names, dtypes, shapes and bytes (NaN payloads and -0.0 included)."""
    assert sorted(actual) == sorted(expected)
    for name, t in expected.items():
        assert actual[name].dtype == t.dtype and actual[name].shape == t.shape, name
        assert torch.equal(raw_bytes(actual[name]), raw_bytes(t)), name


# --- safetensors -------------------------------------------------------------------------------


def test_safetensors_file_is_read_bit_exact_by_safetensors_itself(tmp_path: Path) -> None:
    st = pytest.importorskip("safetensors.torch")
    path = tmp_path / "w.safetensors"
    expected = weights()
    save_weights_file(path, expected)
    assert_bit_exact(st.load_file(path), expected)
    assert_bit_exact(load_weights_file(path), expected)
    assert os.listdir(tmp_path) == ["w.safetensors"]


def test_safetensors_file_holds_no_pickle(tmp_path: Path) -> None:
    """The whole file is the safetensors layout: u64 header size, JSON header, raw bytes."""
    pytest.importorskip("safetensors")
    path = tmp_path / "w.safetensors"
    save_weights_file(path, weights())
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + size])
    ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    assert 8 + size + max(ends) == len(data)  # raw tensor bytes up to the last byte
    assert header["__metadata__"]["format"] == "pt"


def test_tied_weights_save_and_come_back_tied(tmp_path: Path) -> None:
    """safetensors refuses tensors sharing memory: every name is written (any reader sees all
    of them) and load_weights_file ties them again."""
    st = pytest.importorskip("safetensors.torch")
    net = tied_module()
    state = net.state_dict()
    base = torch.arange(12.0)
    state["overlap.a"], state["overlap.b"] = base[:8], base[4:]  # overlapping, not tied
    path = tmp_path / "tied.safetensors"
    save_weights_file(path, state)
    foreign = st.load_file(path)
    assert_bit_exact(foreign, state)
    loaded = load_weights_file(path)
    assert_bit_exact(loaded, state)
    assert loaded["0.weight"] is loaded["1.weight"]
    assert loaded["overlap.a"] is not loaded["overlap.b"]
    fresh = tied_module()
    fresh.load_state_dict({k: v for k, v in loaded.items() if not k.startswith("overlap")})
    assert fresh[0].weight is fresh[1].weight
    assert torch.equal(fresh[1].weight, net[1].weight)


def test_safetensors_written_by_another_tool_loads(tmp_path: Path) -> None:
    st = pytest.importorskip("safetensors.torch")
    path = tmp_path / "hub.safetensors"
    st.save_file({"w": torch.ones(3), "b": torch.zeros(2)}, path)
    assert_bit_exact(load_weights_file(path), {"w": torch.ones(3), "b": torch.zeros(2)})


@pytest.mark.parametrize("damage", ["flipped tensor byte", "truncated", "random bytes", "empty"])
def test_damaged_safetensors_file_is_refused(tmp_path: Path, damage: str) -> None:
    pytest.importorskip("safetensors")
    path = tmp_path / "w.safetensors"
    save_weights_file(path, {"w": torch.arange(1000.0)})
    data = bytearray(path.read_bytes())
    if damage == "flipped tensor byte":  # safetensors has no checksum; fitdp's CRC finds it
        data[-100] ^= 0x10
    elif damage == "truncated":
        data = data[:-10]
    elif damage == "random bytes":
        data = bytearray(os.urandom(len(data)))
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=str(path)):
        load_weights_file(path)


def test_missing_safetensors_package_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "w.safetensors"
    path.write_bytes(b"")
    monkeypatch.setitem(sys.modules, "safetensors", None)  # import safetensors now fails
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ImportError, match=r'pip install "fitdp\[safetensors\]"'):
        save_weights_file(tmp_path / "new.safetensors", {"w": torch.ones(2)})
    with pytest.raises(ImportError, match=r'pip install "fitdp\[safetensors\]"'):
        load_weights_file(path)
    assert os.listdir(tmp_path) == ["w.safetensors"]


# --- fitdp's own format ------------------------------------------------------------------------


def test_fitdp_weights_file_round_trip_keeps_ties_and_loads_with_torch(tmp_path: Path) -> None:
    path = tmp_path / "w.pt"
    state = {**tied_module().state_dict(), **weights()}
    save_weights_file(path, state)
    loaded = load_weights_file(path)
    assert list(loaded) == list(state)
    assert_bit_exact(loaded, state)
    assert loaded["0.weight"].data_ptr() == loaded["1.weight"].data_ptr()  # one storage
    raw = torch.load(path, weights_only=True)
    assert_bit_exact(raw["weights"], state)


@pytest.mark.parametrize("kind", ["plain torch.save", "training checkpoint", "flipped byte"])
def test_fitdp_weights_file_refuses_foreign_and_damaged_files(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "w.pt"
    if kind == "plain torch.save":
        torch.save({"weights": {"w": torch.ones(2)}}, path)
    elif kind == "training checkpoint":
        save_checkpoint(path, {"module": {"w": torch.ones(2)}, "epoch": 1})
    else:
        save_weights_file(path, {"w": torch.arange(100.0)})
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=str(path)) as info:
        load_weights_file(path)
    if kind == "training checkpoint":
        assert "not a weights file" in str(info.value) and "Model.load" in str(info.value)


@pytest.mark.parametrize(
    ("tensors", "match"),
    [
        ([torch.ones(2)], "tensors: got"),
        ({1: torch.ones(2)}, "tensors key 1"),
        ({"w": [1.0, 2.0]}, r"tensors\['w'\]: got \[1.0, 2.0\] \(list\); expected a tensor"),
    ],
)
@pytest.mark.parametrize("name", ["w.pt", "w.safetensors"])
def test_bad_tensors_argument(tmp_path: Path, tensors: Any, match: str, name: str) -> None:
    with pytest.raises(TypeError, match=match):
        save_weights_file(tmp_path / name, tensors)
    assert os.listdir(tmp_path) == []
