"""Checkpoint files: atomic writes, verified loads, RNG state and temp-file housekeeping.

A checkpoint is a plain ``torch.save`` zip (``torch.load(path, weights_only=True)`` reads it)
holding a header entry ``HEADER_KEY: {"format": FORMAT_VERSION}`` that tells it from foreign
files, plus a seal in the zip comment (the last field of a zip, which readers skip):
``b"FITDPCK1"`` and the hex SHA-256 of every byte that is not record data. Record data is
covered by the CRC-32 that torch.save stores per record but torch.load never checks. So saving
hashes only a few KB and costs about one bare torch.save; loading pays one CRC pass.
"""

from __future__ import annotations

import errno
import fnmatch
import hashlib
import os
import random
import re
import secrets
import struct
import threading
import zipfile
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import IO, Any

import numpy as np
import torch

__all__ = [
    "FORMAT_VERSION", "HEADER_KEY", "CheckpointError", "capture_rng_state", "list_checkpoints",
    "load_checkpoint", "remove_stale_temp_files", "restore_rng_state", "save_checkpoint",
]

HEADER_KEY = "__fitdp_checkpoint__"
FORMAT_VERSION = 1

_SEAL_MAGIC = b"FITDPCK1"
_SEAL_LEN = len(_SEAL_MAGIC) + 64  # hex digest: ASCII can never contain the b"PK\5\6" EOCD tag
_EOCD_LEN = 22  # end-of-central-directory record without comment
_LOCAL_HEADER_LEN = 30
_TMP_MARK = ".tmp-"
_TMP_NAME = re.compile(r"^\..+\.tmp-(\d+)-[0-9a-f]{8}$")  # what save_checkpoint names them
_CHUNK = 16 << 20  # CRC read size: big enough to run at memory speed, small enough to not matter
_SCALARS = (int, float, bool, str, type(None))
_DICTS = (dict, OrderedDict)
_TENSORS = (torch.Tensor, torch.nn.Parameter)


class CheckpointError(Exception):
    """A file that cannot be loaded safely as a fitdp checkpoint; the message names it and why."""


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
        with f, _record_crcs_on():
            torch.save(payload, f)
            _seal(f)
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
        _verify(f, path)
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
    algorithm, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
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


@contextmanager
def _record_crcs_on() -> Iterator[None]:
    """Make torch.save store record CRC-32s; the seal relies on them (a global switch since 2.5)."""
    was_on = getattr(torch.serialization, "get_crc32_options", lambda: True)()
    if not was_on:
        torch.serialization.set_crc32_options(True)
    try:
        yield
    finally:
        if not was_on:
            torch.serialization.set_crc32_options(False)


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


def _record_spans(f: IO[bytes], payload_end: int) -> list[tuple[str, int, int, int]]:
    """(name, data start, data size, CRC-32) of each zip record, sorted by offset."""
    spans = []
    with zipfile.ZipFile(f) as archive:
        for info in archive.infolist():
            if info.compress_type != zipfile.ZIP_STORED:
                raise ValueError(f"record {info.filename} is compressed")
            f.seek(info.header_offset)
            local = f.read(_LOCAL_HEADER_LEN)
            if len(local) != _LOCAL_HEADER_LEN or local[:4] != b"PK\x03\x04":
                raise ValueError(f"bad local header for record {info.filename}")
            name_len, extra_len = struct.unpack("<HH", local[26:30])
            start = info.header_offset + _LOCAL_HEADER_LEN + name_len + extra_len
            spans.append((info.filename, start, info.compress_size, info.CRC))
    spans.sort(key=lambda s: s[1])
    end = 0
    for name, start, size, _ in spans:
        if start < end or start + size > payload_end - _EOCD_LEN:
            raise ValueError(f"record {name} overlaps another or the end of the archive")
        end = start + size
    return spans


def _structure_digest(f: IO[bytes], spans: list[tuple[str, int, int, int]], end: int) -> str:
    """SHA-256 of the record table and of every byte in [0, end) outside record data."""
    digest = hashlib.sha256(repr(spans).encode())  # ties each CRC to its name and byte range
    pos = 0
    for _, start, size, _ in spans:
        f.seek(pos)
        digest.update(f.read(start - pos))
        pos = start + size
    f.seek(pos)
    rest = f.read(end - pos)
    # The last 2 bytes are the zip comment length, which sealing changes: hash them as 0 and
    # let _verify check their sealed value.
    digest.update(rest[:-2] + b"\0\0")
    return digest.hexdigest()


def _seal(f: IO[bytes]) -> None:
    """Append the seal to the fresh torch.save zip in ``f`` as the zip comment."""
    end = f.seek(0, os.SEEK_END)
    f.seek(end - _EOCD_LEN)
    eocd = f.read(_EOCD_LEN)
    if eocd[:4] != b"PK\x05\x06" or eocd[-2:] != b"\0\0":
        raise RuntimeError("torch.save wrote an unexpected zip layout; cannot seal it")
    digest = _structure_digest(f, _record_spans(f, end), end)
    f.seek(end - 2)
    f.write(struct.pack("<H", _SEAL_LEN) + _SEAL_MAGIC + digest.encode("ascii"))


def _verify(f: IO[bytes], path: str) -> None:
    """Raise CheckpointError unless the seal and every record CRC of ``f`` match."""
    size = f.seek(0, os.SEEK_END)
    if size == 0:
        raise CheckpointError(f"{path}: file is empty")
    f.seek(max(0, size - _SEAL_LEN - 2))
    tail = f.read()
    if size < _SEAL_LEN + _EOCD_LEN or tail[2:2 + len(_SEAL_MAGIC)] != _SEAL_MAGIC:
        raise CheckpointError(
            f"{path}: no fitdp seal at the end: truncated, or not written by fitdp "
            f"(plain torch.save files are foreign)"
        )
    end = size - _SEAL_LEN
    if struct.unpack("<H", tail[:2])[0] != _SEAL_LEN:
        raise CheckpointError(f"{path}: corrupted zip end record")
    try:  # a damaged archive can make the zip parser fail in many ways; each means "corrupt"
        spans = _record_spans(f, end)
        digest = _structure_digest(f, spans, end)
    except Exception as exc:
        raise CheckpointError(f"{path}: corrupted zip structure: {exc}") from exc
    if digest.encode("ascii") != tail[2 + len(_SEAL_MAGIC):]:
        raise CheckpointError(f"{path}: corrupted: zip headers do not match the seal")
    buf = memoryview(bytearray(_CHUNK))
    for name, start, size, crc in spans:
        f.seek(start)
        actual, left = 0, size
        while left:
            got = f.readinto(buf[: min(left, _CHUNK)])  # type: ignore[attr-defined]
            if not got:
                raise CheckpointError(f"{path}: truncated inside record {name}")
            actual, left = zlib.crc32(buf[:got], actual), left - got
        if actual != crc:
            raise CheckpointError(f"{path}: corrupted: CRC-32 mismatch in record {name}")


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
