"""One atomic file writer, shared by checkpoints, weights files and export.

``atomic_write(path)`` hands out a temporary file ``.{name}.tmp-{pid}-{random}`` in the same
folder; when the ``with`` block ends it is flushed, fsynced and renamed over ``path``, and the
folder is fsynced, so a crash at any moment leaves the old file or the new one. The writer's
pid in the name lets a later save recognise the leftovers of a writer that was killed.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import IO

__all__ = ["TEMP_NAME", "atomic_write", "fsync_folder", "remove_stale_temp_files"]

#: What atomic_write names its temporary files: ``.{target}.tmp-{pid}-{8 hex digits}``.
TEMP_NAME = re.compile(r"^\.(?P<target>.+)\.tmp-(?P<pid>\d+)-[0-9a-f]{8}$")


@contextmanager
def atomic_write(path: str | os.PathLike[str]) -> Iterator[IO[bytes]]:
    """Write ``path`` through a temporary file that replaces it only once complete and durable.

    Before writing, temporary files of ``path`` left by writers that are gone (their pid is
    not alive on this host) are removed. On any exception in the block (KeyboardInterrupt
    too) the temporary file is removed, ``path`` is untouched and the exception propagates.

    Args:
        path: the destination; its folder must exist.

    Yields:
        The temporary file, open for reading and writing (binary, seekable).

    Raises:
        OSError: creating, writing, syncing or renaming failed (naming ``path`` when the
            failed call named no file: a full disk is errno ENOSPC); nothing is left behind.

    Example:
        >>> with atomic_write("notes.bin") as f:
        ...     _ = f.write(b"complete or absent")
        >>> open("notes.bin", "rb").read()
        b'complete or absent'
    """
    path = os.path.abspath(os.fspath(path))
    folder, name = os.path.split(path)
    remove_stale_temp_files(folder, target=name)
    tmp = os.path.join(folder, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    # 0o666 & ~umask, like any file the user writes (mkstemp would force 0o600).
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    old = None
    try:
        with os.fdopen(fd, "r+b") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        old = _hold_old_file(path)
        os.replace(tmp, path)
    except BaseException as exc:  # KeyboardInterrupt too: never leave a temp file behind
        if old is not None:
            os.close(old)
        with suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.errno is not None and exc.filename is None:
            # A failed write names no file (a full disk: "No space left on device").
            raise OSError(exc.errno, exc.strerror, path) from exc
        raise
    try:
        fsync_folder(folder)
    finally:
        if old is not None:  # its last close frees its blocks: ~55 ms per 300 MB on ext4
            threading.Thread(target=os.close, args=(old,), daemon=True).start()


def remove_stale_temp_files(
    folder: str | os.PathLike[str], target: str | None = None
) -> list[str]:
    """Delete temporary files that killed writers left in ``folder``.

    A temp file whose writer process is still alive on this host is kept, so a save running
    next to us is not sabotaged (on a folder shared across hosts this check cannot see the
    other hosts' processes, and a reused pid keeps a leftover until that process ends).

    Args:
        folder: the folder to clean; a missing folder is fine.
        target: only the temp files of this file name (``"model.ckpt"``); None: all.

    Returns:
        Paths of the removed files.

    Example:
        >>> remove_stale_temp_files("no-such-folder")
        []
    """
    folder = os.fspath(folder)
    removed: list[str] = []
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return removed
    for entry in entries:
        match = TEMP_NAME.match(entry.name)
        if not match or (target is not None and match["target"] != target):
            continue
        if not entry.is_file(follow_symlinks=False) or _pid_alive(int(match["pid"])):
            continue
        with suppress(FileNotFoundError):  # another process may clean it first
            os.unlink(entry.path)
            removed.append(entry.path)
    return removed


def fsync_folder(folder: str) -> None:
    """Make a rename in ``folder`` durable; skipped where folders cannot be opened or fsynced."""
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


def _hold_old_file(path: str) -> int | None:
    """Open the file about to be replaced, so freeing it can be left to a thread (POSIX only:
    Windows cannot replace an open file)."""
    if os.name == "nt":
        return None
    try:
        return os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # never blocks, even on a FIFO
    except OSError:  # no previous file, or unreadable: the rename frees it inline
        return None


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
