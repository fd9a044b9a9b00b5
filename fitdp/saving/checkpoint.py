"""Checkpoint files: atomic writes, verified loads, RNG state and temp-file housekeeping.

A checkpoint is a plain ``torch.save`` zip (``torch.load(path, weights_only=True)`` reads it)
holding a header entry ``HEADER_KEY: {"format": FORMAT_VERSION}`` that tells it from foreign
files, and sealed against damage (``fitdp.saving.seal``). It is written by ``fitdp.saving.atomic``.
"""

from __future__ import annotations

import fnmatch
import os
import random
from collections import OrderedDict
from typing import Any, cast

import numpy as np
import torch

from fitdp.checks import check_path
from fitdp.saving.atomic import TEMP_NAME, atomic_write, remove_stale_temp_files
from fitdp.saving.seal import CheckpointError, verify, write_sealed

__all__ = [
    "FORMAT_VERSION", "HEADER_KEY", "CheckpointError", "capture_rng_state", "check_state",
    "list_checkpoints", "load_checkpoint", "remove_stale_temp_files", "restore_rng_state",
    "save_checkpoint",
]

HEADER_KEY = "__fitdp_checkpoint__"
FORMAT_VERSION = 1

_SCALARS = (int, float, bool, str, type(None))
_DICTS = (dict, OrderedDict)
_TENSORS = (torch.Tensor, torch.nn.Parameter)


def save_checkpoint(path: str | os.PathLike[str], state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically: a crash leaves the old file or the new one.

    The data go to ``.{name}.tmp-{pid}-{random}`` in the same folder, are flushed, fsynced and
    renamed onto ``path``; the folder is then fsynced so the rename survives a power cut.
    Temporary files of ``path`` left by killed saves are removed first.

    Args:
        path: destination file; missing parent folders are created.
        state: dict of tensors, int/float/bool/str/None, lists, tuples and dicts (str or int
            keys; int keys because ``optimizer.state_dict()`` uses them). Not modified.

    Raises:
        TypeError: ``state`` holds anything else, or ``path`` is not a path; nothing is written.
        ValueError: ``state`` holds a reference cycle or the reserved key ``HEADER_KEY``, or
            ``path`` is a folder, a FIFO or another special file.
        OSError: writing failed; the temporary file is gone and ``path`` is untouched.
    """
    path = check_path("path", path)
    check_state(state)
    write_checkpoint(path, state)


def check_state(state: Any) -> None:
    """Raise TypeError/ValueError at the first thing in ``state`` a checkpoint cannot hold.

    Args:
        state: what would be passed to :func:`save_checkpoint`.

    Raises:
        TypeError: not a dict, or a value or key of an unsupported type.
        ValueError: a reference cycle, or the reserved key ``HEADER_KEY``.
    """
    if type(state) not in _DICTS:
        raise TypeError(f"state: expected a dict, got {type(state).__name__}")
    if HEADER_KEY in state:
        raise ValueError(f"state[{HEADER_KEY!r}] is reserved for the fitdp header; rename it")
    _check_value(state, "state", set())


def write_checkpoint(path: str, state: dict[str, Any], **header: Any) -> None:
    """Write an already checked ``state`` (with ``header`` entries) to the checked ``path``."""
    payload = {**state, HEADER_KEY: {"format": FORMAT_VERSION, **header}}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_write(path) as f:
        write_sealed(f, payload)


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Verify and load a file written by :func:`save_checkpoint`, on the CPU.

    Only ``torch.load(weights_only=True)`` ever unpickles, and only after the seal and every
    record CRC checked out; there is no fallback to full unpickling.

    Args:
        path: the checkpoint file.

    Returns:
        The saved dict, without the fitdp header entry.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is a folder, a FIFO or another special file.
        CheckpointError: the file is empty, truncated, corrupted, foreign, from a newer fitdp,
            or its pickle asks for anything but tensors and plain containers.
    """
    return read_checkpoint(path)[1]


def read_checkpoint(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """:func:`load_checkpoint`, returning ``(header, state)``."""
    path = check_path("path", path, must_exist=True)
    with open(path, "rb") as f:
        verify(f, path)
        f.seek(0)  # load from the verified handle: a concurrent os.replace can't swap files
        try:
            state = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as exc:  # malicious or unsupported pickle: any error means "refuse"
            raise CheckpointError(
                f"{path}: torch.load(weights_only=True) refused it: {exc}"
            ) from exc
    header = state.pop(HEADER_KEY, None) if isinstance(state, dict) else None
    if not isinstance(header, dict) or not isinstance(header.get("format"), int):
        raise CheckpointError(f"{path}: foreign file: a torch file without the fitdp header")
    if header["format"] > FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: written in checkpoint format {header['format']}, but this fitdp reads "
            f"format {FORMAT_VERSION} at most; upgrade fitdp"
        )
    return header, state


def capture_rng_state() -> dict[str, Any]:
    """Snapshot the torch (CPU and CUDA), Python ``random`` and NumPy global RNGs.

    Returns:
        A dict of tensors and plain Python values that survives ``weights_only`` loading.
    """
    version, internal, gauss_next = random.getstate()
    # The global RandomState is always MT19937, so legacy=True gives the tuple, never the dict.
    np_state = cast(
        "tuple[str, np.ndarray, int, int, float]", np.random.get_state(legacy=True)
    )
    algorithm, keys, pos, has_gauss, cached_gaussian = np_state
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "algorithm": str(algorithm),
            "keys": torch.from_numpy(keys.astype(np.int64)),  # torch has no full uint32 support
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back the RNG states taken by :func:`capture_rng_state`.

    CUDA states are restored for the devices present in both the snapshot and this machine.

    Args:
        state: a dict from :func:`capture_rng_state` (possibly through a checkpoint).
    """
    missing = {"torch", "python", "numpy"} - set(state)
    if missing:
        raise ValueError(
            f"state: missing RNG entries {sorted(missing)}; pass a dict made by capture_rng_state()"
        )
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    npst = state["numpy"]
    keys = np.asarray(torch.as_tensor(npst["keys"]).numpy(), dtype=np.uint32)
    np.random.set_state(
        (npst["algorithm"], keys, npst["pos"], npst["has_gauss"], npst["cached_gaussian"])
    )
    cuda_states = state.get("cuda") or []
    if cuda_states and torch.cuda.is_available():
        for device, cuda_state in enumerate(cuda_states[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device)


def list_checkpoints(folder: str | os.PathLike[str], pattern: str = "*.ckpt") -> list[str]:
    """Complete checkpoints in ``folder`` whose name matches ``pattern``, newest first.

    Temporary files never match: renaming is the last step of a save, so every file under
    its final name is complete.

    Args:
        folder: the folder to scan; a missing folder holds no checkpoints.
        pattern: ``fnmatch`` pattern for the file names.

    Returns:
        Paths, sorted by modification time (then name), newest first.
    """
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        return []
    found = [
        (entry.stat().st_mtime_ns, entry.name, entry.path)
        for entry in os.scandir(folder)
        if fnmatch.fnmatch(entry.name, pattern)
        and not TEMP_NAME.match(entry.name)
        and entry.is_file()
    ]
    return [p for _, _, p in sorted(found, reverse=True)]


def _check_value(value: Any, where: str, active: set[int]) -> None:
    """Raise TypeError/ValueError at the first thing ``weights_only`` loading would reject."""
    kind = type(value)
    if kind in _SCALARS or kind in _TENSORS:
        return
    if isinstance(value, torch.Tensor):
        raise TypeError(
            f"{where}: tensor subclass {kind.__name__} cannot be loaded with "
            f"weights_only=True; store value.as_subclass(torch.Tensor) instead"
        )
    if kind not in _DICTS and kind not in (list, tuple):
        raise TypeError(
            f"{where}: got {kind.__module__}.{kind.__qualname__}; a checkpoint holds only "
            f"tensors, int/float/bool/str/None, lists, tuples and dicts (numpy arrays: "
            f"torch.from_numpy(a); objects: their state_dict())"
        )
    if id(value) in active:
        raise ValueError(f"{where}: reference cycle; a checkpoint must be a tree")
    active.add(id(value))
    if kind in _DICTS:
        for key, item in value.items():
            if type(key) not in (str, int):
                raise TypeError(
                    f"{where}: key {key!r} is a {type(key).__name__}; use str (or int) keys"
                )
            _check_value(item, f"{where}[{key!r}]", active)
    else:
        for index, item in enumerate(value):
            _check_value(item, f"{where}[{index}]", active)
    active.discard(id(value))
