"""Weights-only files: safetensors for sharing, a sealed fitdp file otherwise.

A path ending in ``.safetensors`` is written with the ``safetensors`` package (an optional
extra): no pickle at all, readable by any safetensors reader. fitdp adds two metadata entries
that other readers ignore: the CRC-32 of each tensor (``fitdp.crc32``; safetensors itself has
no checksum, so fitdp refuses a damaged file), and which names were tied (``fitdp.tied``).
safetensors refuses tensors that share memory, so each tied name is written as its own copy
(every reader sees every name; the file holds the tied tensor once per name) and
:func:`load_weights_file` ties them again. Any other path is a sealed fitdp file
(``saving.checkpoint``) holding only the weights; it loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Mapping
from typing import Any

import torch

from fitdp.checks import check_path, fail
from fitdp.saving.atomic import atomic_write
from fitdp.saving.checkpoint import CheckpointError, check_state, read_checkpoint, write_checkpoint

__all__ = ["load_weights_file", "save_weights_file"]

_KIND = "weights"
_CRC_KEY = "fitdp.crc32"
_TIED_KEY = "fitdp.tied"


def save_weights_file(path: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor]) -> None:
    """Write ``tensors`` to ``path`` atomically, as safetensors when it ends in ``.safetensors``.

    Args:
        path: destination file; missing parent folders are created.
        tensors: name -> tensor (e.g. ``module.state_dict()``); tensors may share memory
            (tied weights). Saved as CPU tensors.

    Raises:
        TypeError: ``tensors`` is not a mapping of str to tensors, or ``path`` not a path.
        ValueError: ``path`` is a folder or a special file.
        ImportError: a ``.safetensors`` path without the safetensors package.
        OSError: writing failed; ``path`` is untouched.
    """
    path = check_path("path", path)
    weights = _check_tensors(tensors)
    if not _is_safetensors(path):
        check_state({"weights": weights})
        write_checkpoint(path, {"weights": weights}, kind=_KIND)
        return
    st = _safetensors()
    flat: dict[str, torch.Tensor] = {}
    crcs: dict[str, int] = {}
    tied: dict[str, str] = {}  # alias -> the first name of the same weight
    first: dict[tuple[Any, ...], str] = {}
    storages: set[int] = set()
    for name, t in weights.items():
        key = _alias_key(t)
        if key is not None and key in first:
            tied[name] = first[key]
        elif key is not None:
            first[key] = name
        host = t.detach().to("cpu").contiguous()
        if host.numel() and host.untyped_storage().data_ptr() in storages:
            host = host.clone()  # safetensors refuses tensors that share memory
        storages.add(host.untyped_storage().data_ptr())
        flat[name], crcs[name] = host, _crc(host)
    metadata = {"format": "pt", _CRC_KEY: json.dumps(crcs), _TIED_KEY: json.dumps(tied)}
    data = st.save(flat, metadata=metadata)  # costs one more host copy of the weights
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_write(path) as f:
        f.write(data)


def load_weights_file(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Read a file written by :func:`save_weights_file` (or any safetensors file), on the CPU.

    Args:
        path: the file; ``.safetensors`` is read with the safetensors package.

    Returns:
        Name -> tensor; names that were tied when saved are the same tensor again.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is a folder or a special file.
        ImportError: a ``.safetensors`` path without the safetensors package.
        CheckpointError: the file is damaged, foreign or a training checkpoint.
    """
    path = check_path("path", path, must_exist=True)
    if not _is_safetensors(path):
        header, state = read_checkpoint(path)
        weights = state.get("weights")
        if header.get("kind") != _KIND or not isinstance(weights, dict) or not all(
                isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in weights.items()):
            raise CheckpointError(
                f"{path}: a fitdp checkpoint, not a weights file: load it with "
                f"Model.load(path), or take fitdp.saving.checkpoint.load_checkpoint(path)['module']"
            )
        return weights
    st = _safetensors()
    try:
        with st.safe_open(path, framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        crcs = json.loads(metadata.get(_CRC_KEY, "{}"))
        tied = json.loads(metadata.get(_TIED_KEY, "{}"))
    except Exception as exc:  # a damaged file can fail in many ways; each means "refuse"
        raise CheckpointError(f"{path}: not a readable safetensors file: {exc}") from exc
    for name, crc in crcs.items():
        if name in tensors and _crc(tensors[name]) != crc:
            raise CheckpointError(f"{path}: corrupted: CRC-32 mismatch in tensor {name!r}")
    for alias, name in tied.items():
        a, b = tensors.get(alias), tensors.get(name)
        if a is not None and b is not None and a.dtype == b.dtype and torch.equal(a, b):
            tensors[alias] = b
    return tensors


def _check_tensors(tensors: Any) -> dict[str, torch.Tensor]:
    """``tensors`` as a dict, or a TypeError naming the first bad entry."""
    if not isinstance(tensors, Mapping):
        fail("tensors", tensors, "a mapping of names to tensors (e.g. module.state_dict())",
             error=TypeError)
    for name, t in tensors.items():
        if not isinstance(name, str):
            fail(f"tensors key {name!r}", name, "a str name", error=TypeError)
        if not isinstance(t, torch.Tensor):
            fail(f"tensors[{name!r}]", t, "a tensor", error=TypeError)
    return dict(tensors)


def _alias_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What makes two tensors the same weight: storage, offset, shape, stride, dtype."""
    if t.layout != torch.strided or not t.numel():
        return None
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
            t.stride(), t.dtype)


def _crc(t: torch.Tensor) -> int:
    """CRC-32 of a CPU tensor's bytes (row-major)."""
    return zlib.crc32(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)


def _is_safetensors(path: str) -> bool:
    return path.lower().endswith(".safetensors")


def _safetensors() -> Any:
    """``safetensors.torch``, or an ImportError that says how to install it."""
    try:
        import safetensors.torch
    except ImportError as exc:
        raise ImportError(
            "reading and writing .safetensors files needs the safetensors package: "
            'pip install "fitdp[safetensors]" (or pip install safetensors); other file names '
            "are saved in fitdp's own format"
        ) from exc
    return safetensors.torch
