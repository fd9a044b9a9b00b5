"""Checkpoint files: atomic writes, verified loads, RNG state and temp-file housekeeping.

A checkpoint is a plain ``torch.save`` zip (``torch.load(path, weights_only=True)`` reads it)
holding a header entry ``HEADER_KEY: {"format": FORMAT_VERSION}`` that tells it from foreign
files, and sealed against damage (``fitdp.seal``).
"""

from __future__ import annotations

import errno
import fnmatch
import os
import random
import re
import secrets
import threading
from collections import OrderedDict
from contextlib import suppress
from typing import IO, Any, cast

import numpy as np
import torch

from fitdp.seal import CheckpointError, record_crcs_on, seal, verify

__all__ = [
    "FORMAT_VERSION", "HEADER_KEY", "CheckpointError", "capture_rng_state", "list_checkpoints",
    "load_checkpoint", "remove_stale_temp_files", "restore_rng_state", "save_checkpoint",
]

HEADER_KEY = "__fitdp_checkpoint__"
FORMAT_VERSION = 1

_TMP_MARK = ".tmp-"
_WRITEBACK = 32 << 20  # start writing to disk every 32 MB while saving
_TMP_NAME = re.compile(r"^\..+\.tmp-(\d+)-[0-9a-f]{8}$")  # what save_checkpoint names them
_SCALARS = (int, float, bool, str, type(None))
_DICTS = (dict, OrderedDict)
_TENSORS = (torch.Tensor, torch.nn.Parameter)


def save_checkpoint(path: str | os.PathLike[str], state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically: a crash leaves the old file or the new one.

    The data go to ``.{name}.tmp-{pid}-{random}`` in the same folder, are flushed, fsynced and
    renamed onto ``path``; the folder is then fsynced so the rename survives a power cut.

    Args:
        path: destination file; missing parent folders are created.
        state: dict of tensors, int/float/bool/str/None, lists, tuples and dicts (str or int
            keys; int keys because ``optimizer.state_dict()`` uses them). Not modified.

    Raises:
        TypeError: ``state`` holds anything else; nothing is written.
        ValueError: ``state`` holds a reference cycle or the reserved key ``HEADER_KEY``.
        OSError: writing failed; the temporary file is gone and ``path`` is untouched.
    """
    if type(state) not in _DICTS:
        raise TypeError(f"state: expected a dict, got {type(state).__name__}")
    if HEADER_KEY in state:
        raise ValueError(f"state[{HEADER_KEY!r}] is reserved for the fitdp header; rename it")
    _check_value(state, "state", set())
    payload = {**state, HEADER_KEY: {"format": FORMAT_VERSION}}

    path = os.path.abspath(os.fspath(path))
    folder, name = os.path.split(path)
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{name}{_TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")
    # 0o666 & ~umask, like any file the user writes (mkstemp would force 0o600).
    f = os.fdopen(os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666), "r+b")
    old = None
    try:
        with f, record_crcs_on():
            torch.save(payload, cast(IO[bytes], _EarlyWriteback(f)))  # write+flush suffice
            seal(f)
            f.flush()
            os.fsync(f.fileno())
        old = _hold_old_file(path)
        os.replace(tmp, path)
    except BaseException:  # also KeyboardInterrupt: never leave a half-written temp file
        if old is not None:
            os.close(old)
        with suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    try:
        _fsync_folder(folder)
    finally:
        if old is not None:  # its last close frees its blocks: ~55 ms per 300 MB on ext4
            threading.Thread(target=os.close, args=(old,), daemon=True).start()


class _EarlyWriteback:
    """Hands torch.save's writes to ``f`` and, every ``_WRITEBACK`` bytes, asks the kernel to
    start writing them to disk, so the disk works while torch.save still serialises and the
    final fsync has little left to wait for."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f = f
        self.flushed = 0
        self.written = 0

    def write(self, data: bytes) -> int:
        n = self.f.write(data)
        self.written += n
        if self.written - self.flushed >= _WRITEBACK and hasattr(os, "posix_fadvise"):
            self.f.flush()
            # DONTNEED on dirty pages starts their writeback without waiting for it.
            os.posix_fadvise(self.f.fileno(), self.flushed, self.written - self.flushed,
                             os.POSIX_FADV_DONTNEED)
            self.flushed = self.written
        return n

    def flush(self) -> None:
        self.f.flush()


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
        CheckpointError: the file is empty, truncated, corrupted, foreign, from a newer fitdp,
            or its pickle asks for anything but tensors and plain containers.
    """
    path = os.fspath(path)
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
    return state


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
        and not _TMP_NAME.match(entry.name)
        and entry.is_file()
    ]
    return [p for _, _, p in sorted(found, reverse=True)]


def remove_stale_temp_files(folder: str | os.PathLike[str]) -> list[str]:
    """Delete temporary files that a killed save left in ``folder``.

    A temp file whose writer process is still alive on this host is kept, so a save running
    next to us is not sabotaged (on a folder shared across hosts this check cannot see the
    other hosts' processes).

    Args:
        folder: the folder to clean; a missing folder is fine.

    Returns:
        Paths of the removed files.
    """
    folder = os.fspath(folder)
    removed: list[str] = []
    for entry in os.scandir(folder) if os.path.isdir(folder) else []:
        match = _TMP_NAME.match(entry.name)
        if not match or not entry.is_file() or _pid_alive(int(match[1])):
            continue
        with suppress(FileNotFoundError):  # another process may clean it first
            os.unlink(entry.path)
            removed.append(entry.path)
    return removed


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


def _hold_old_file(path: str) -> int | None:
    """Open the file about to be replaced, so freeing it can be left to a thread (POSIX only:
    Windows cannot replace an open file)."""
    if os.name == "nt":
        return None
    try:
        return os.open(path, os.O_RDONLY)
    except OSError:  # no previous file, or unreadable: the rename frees it inline
        return None


def _fsync_folder(folder: str) -> None:
    """Make the rename durable; skipped where folders cannot be opened or fsynced."""
    try:
        fd = os.open(folder, os.O_RDONLY)  # Windows and unreadable folders refuse this
    except PermissionError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    """True if process ``pid`` exists on this host (it may belong to another user)."""
    if os.name == "nt":  # os.kill(pid, 0) would terminate the process there
        return pid == os.getpid()
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
