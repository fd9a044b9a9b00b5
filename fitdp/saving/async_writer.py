"""Checkpoint saves that do not stall training: a host snapshot, then the file, on a thread.

``AsyncCheckpointWriter.submit`` copies every tensor of the state into host buffers (reused
from the previous save when the sizes match, so a save costs a memcpy, not an allocation) and
returns; a background thread writes the same file :func:`fitdp.saving.checkpoint.save_checkpoint`
would, with the same atomic write. Tensors named in ``submit(..., defer=...)`` (the weights and
optimizer state, which only the next optimizer step changes) are copied by that thread instead,
while the caller runs the next forward and backward; whatever changes them first waits for
``copied`` (``Model`` does this through :mod:`fitdp.saving.fence`). The GIL-heavy part
of a save (torch's CRC pass over every byte) is not done on that thread: ``fitdp.saving.seal``
computes CRCs with ``zlib``, which releases the GIL, so training threads keep running while
the file is written.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from contextlib import suppress
from typing import Any

import torch

from fitdp.checks import check_path, fail
from fitdp.saving.checkpoint import check_state, write_checkpoint

__all__ = ["AsyncCheckpointWriter"]

_Copy = tuple[torch.Tensor, torch.Tensor]  # (host buffer, bytes of the source storage)
_WRITER_NICE = 10  # conventional for background work: ~10% of a core against a busy thread


class AsyncCheckpointWriter:
    """Writes checkpoints on a background thread, at most one at a time.

    ``submit(path, state)`` returns once ``state`` is copied to host memory: later training
    cannot change what is saved. The file is the one ``save_checkpoint(path, state)`` writes,
    written atomically (temp file, fsync, rename, folder fsync), so a crash or SIGKILL at any
    moment leaves the previous complete file. A second ``submit`` first waits for the save in
    flight; a failed save raises at the next ``submit`` or at ``wait()``. Use it from one
    thread. It keeps one host copy of the last state's tensors until ``close()`` (pinned
    memory for CUDA tensors). On Linux the writer thread runs at nice +10 once its copy is
    done (the copy is what the next optimizer step may wait for): where all cores are busy,
    training keeps them and the file takes longer.

    Example:
        >>> net = torch.nn.Linear(4, 2)
        >>> with AsyncCheckpointWriter() as writer:
        ...     writer.submit("net.ckpt", {"module": net.state_dict(), "step": 1})
        ...     # train on here: the file is written meanwhile
        >>> from fitdp.saving.checkpoint import load_checkpoint
        >>> load_checkpoint("net.ckpt")["step"]
        1
    """

    def __init__(self) -> None:
        self._snapshot = _HostSnapshot()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._copied = threading.Event()
        self._copied.set()

    @property
    def copied(self) -> threading.Event:
        """Set once the last submit's tensors are all in host memory (at once, unless it
        deferred some): from then on they may change. ``wait()`` implies it."""
        return self._copied

    @property
    def in_flight(self) -> bool:
        """True while a submitted save is not yet durable."""
        return self._thread is not None and self._thread.is_alive()

    def submit(self, path: str | os.PathLike[str], state: dict[str, Any],
               on_durable: Callable[[str], object] | None = None, *,
               defer: Iterable[torch.Tensor] = ()) -> None:
        """Snapshot ``state`` to host memory and save it to ``path`` in the background.

        Args:
            path: destination file; missing parent folders are created.
            state: what :func:`fitdp.saving.checkpoint.save_checkpoint` accepts. Not modified, and
                free to change as soon as this returns, but for ``defer``'s tensors.
            on_durable: called with the absolute path on the writer thread once the file is
                renamed into place and durable (e.g. to delete older checkpoints only when
                the new one is safe); an exception in it fails the save.
            defer: tensors of ``state`` (by storage) the caller leaves unchanged until
                ``copied`` is set: the writer thread copies them, and ``submit`` returns
                without that copy (for a 300 MB state, ~65 ms on a 2-core Intel box).

        Raises:
            TypeError, ValueError: bad ``path``, ``state`` or ``on_durable`` (as
                ``save_checkpoint``), or the writer is closed; nothing is submitted.
            BaseException: the previous save failed (its own exception, e.g. ``OSError``);
                this ``state`` is not submitted, submit again to retry.
        """
        if self._closed:
            fail("AsyncCheckpointWriter.submit", "a closed writer", "an open writer",
                 "create a new AsyncCheckpointWriter", described=True)
        path = os.path.abspath(check_path("path", path))  # the thread must not see a chdir
        check_state(state)
        if on_durable is not None and not callable(on_durable):
            fail("on_durable", on_durable, "a callable taking the path, or None",
                 error=TypeError)
        self.wait()  # at most one save in flight; its buffers are ours again
        snapshot, late = self._snapshot.take(state, {k for k in map(_storage_key, defer) if k})
        self._copied = threading.Event()
        if not late:
            self._copied.set()
        self._thread = threading.Thread(
            target=self._write, args=(path, snapshot, late, on_durable),
            name="fitdp-checkpoint-writer",
        )  # not a daemon: a script that ends right after submit still finishes the file
        self._thread.start()

    def wait(self) -> None:
        """Return once the last submitted save is durable.

        Raises:
            BaseException: that save failed (its own exception); reported once.
        """
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        """Wait for the save in flight, then free the host buffers; idempotent.

        Raises:
            BaseException: the last save failed.
        """
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._snapshot = _HostSnapshot()

    def __enter__(self) -> AsyncCheckpointWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _write(self, path: str, state: dict[str, Any], late: list[_Copy],
               on_durable: Callable[[str], object] | None) -> None:
        try:
            try:  # at the caller's priority: the next optimizer step may be waiting
                _copy(late)
            finally:
                self._copied.set()  # a failed copy fails the save below, never hangs a step
            _lower_this_threads_priority()
            write_checkpoint(path, state)
            if on_durable is not None:
                on_durable(path)
        except BaseException as exc:  # handed to the caller's thread by wait()
            note = f"raised by the background checkpoint save to {path!r}"
            if hasattr(exc, "add_note"):  # Python 3.11+
                exc.add_note(note)
            self._error = exc


def _storage_key(t: torch.Tensor) -> int | None:
    """The data pointer of ``t``'s storage; None for a wrapper subclass without one (a
    sharded engine's shard: its state is copied inside ``submit``, as before)."""
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return None


def _copy(late: list[_Copy]) -> None:
    """The deferred part of a snapshot, storage by storage; a tensor copy releases the GIL,
    so the training thread runs meanwhile (the copy is memory-bound: ~30 ms per 300 MB)."""
    for dst, src in late:
        dst.copy_(src)


def _lower_this_threads_priority() -> None:
    """Nice the calling thread by ``_WRITER_NICE``, so that where every core is busy (torch's
    threads, other jobs) training keeps the CPU and the save takes what is left. Linux only:
    there the nice value belongs to the thread; elsewhere a thread id would name a process."""
    if sys.platform.startswith("linux"):
        tid = threading.get_native_id()
        with suppress(OSError):  # e.g. a seccomp sandbox refusing setpriority
            os.setpriority(os.PRIO_PROCESS, tid,
                           min(19, os.getpriority(os.PRIO_PROCESS, tid) + _WRITER_NICE))


class _HostSnapshot:
    """Host copies of a state's tensors in buffers reused from the previous snapshot.

    Each storage is copied whole (as torch.save writes it) into a uint8 buffer, and tensors
    are rebuilt as views of it with their offset, size and stride, so tensors that shared a
    storage still share it in the file. The i-th storage met reuses the previous snapshot's
    i-th buffer when the byte sizes (and pinning) match. A storage whose data pointer is
    in ``later`` is not copied now: ``take`` returns its copy for the writer thread.
    """

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []

    def take(self, state: dict[str, Any], later: set[int]) -> tuple[dict[str, Any], list[_Copy]]:
        """A copy of ``state`` whose tensors live in this snapshot's host buffers, and the
        copies into them left to do (the storages of ``later``)."""
        old, new, late = self._buffers, list[torch.Tensor](), list[_Copy]()
        storages: dict[tuple[torch.device, int], torch.UntypedStorage] = {}
        memo: dict[int, torch.Tensor] = {}

        def host_storage(t: torch.Tensor) -> torch.UntypedStorage:
            src = t.untyped_storage()
            key = (t.device, src.data_ptr())
            if key[1] and key in storages:
                return storages[key]
            pin = t.device.type == "cuda"  # page-locked: the copy from the GPU is a DMA
            i = len(new)
            reuse = i < len(old) and old[i].numel() == src.nbytes() and old[i].is_pinned() == pin
            buf = old[i] if reuse else torch.empty(src.nbytes(), dtype=torch.uint8,
                                                   pin_memory=pin)
            if key[1] in later and t.device.type == "cpu":
                late.append((buf, torch.empty(0, dtype=torch.uint8).set_(src)))
            else:
                buf.untyped_storage().copy_(src)
            new.append(buf)
            storages[key] = buf.untyped_storage()
            return storages[key]

        def tensor(t: torch.Tensor) -> torch.Tensor:
            if id(t) in memo:  # the same object twice stays one object, as in torch.save
                return memo[id(t)]
            if t.layout != torch.strided or t.is_conj() or t.is_neg() or t.is_quantized \
                    or t.device.type == "meta":
                copy = t.detach().clone() if t.device.type == "meta" else \
                    t.detach().to("cpu", copy=True)
            else:
                copy = torch.empty(0, dtype=t.dtype).set_(
                    host_storage(t), t.storage_offset(), t.size(), t.stride())
            if isinstance(t, torch.nn.Parameter):
                copy = torch.nn.Parameter(copy, requires_grad=t.requires_grad)
            elif t.requires_grad:
                copy.requires_grad_(True)
            memo[id(t)] = copy
            return copy

        def walk(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return tensor(value)
            if isinstance(value, (dict, OrderedDict)):
                out = type(value)((k, walk(v)) for k, v in value.items())
                if hasattr(value, "__dict__"):  # OrderedDict attributes: state_dict()._metadata
                    out.__dict__.update(value.__dict__)
                return out
            if isinstance(value, (list, tuple)):
                return type(value)(walk(v) for v in value)
            return value

        snapshot = walk(state)
        self._buffers = new
        return snapshot, late
