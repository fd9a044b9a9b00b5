"""Checkpoints of sharded models through ``torch.distributed.checkpoint`` (DCP): every rank
writes its own shards, none gathers the whole model.

A checkpoint is a folder: ``step-<n>/`` subfolders (``n`` the global step), each one DCP
checkpoint, and a ``LATEST`` file naming the newest complete one. ``LATEST`` is replaced
(``os.replace``, atomic) only after DCP's metadata is written, which DCP does on the
coordinator rank after every rank's shards are on disk, and after ``checksums.json`` (the
size and CRC-32 of every file of the step, each rank summing the files it wrote) is, so a
crash at any moment (SIGKILL included) leaves ``LATEST`` naming a whole checkpoint.
``damaged_file`` checks a step against its checksums before anything reads it (the
checksums list the step's files exactly: a file they do not list is refused too). Loading
reshards: the same folder loads on another world size, and into one process (plain tensors).

Nothing read from the folder can run code. DCP's own reader unpickles ``.metadata`` with
``pickle.load``, and checksums that whoever writes the folder can recompute do not stop a
crafted one; ``read_metadata`` reads it with an unpickler that admits only DCP's metadata
types (as ``torch.load(weights_only=True)`` admits only tensors and plain values), and
``load`` hands DCP that checked index, so DCP's ``pickle.load`` never runs. The shards
themselves DCP reads with ``torch.load(weights_only=True)``; an index entry that would make
it read anything else (a pickled object, a transformed stream, a file outside the step) is
refused. A refusal is a ``RefusedFile`` naming the file.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import warnings
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fitdp.executor.fsdp import is_shard

# torch.distributed.checkpoint is imported by the functions that use it: it costs about 0.8 s,
# which ``import fitdp`` would otherwise charge every user.

LATEST = "LATEST"
SUMS = "checksums.json"  # {"files": {name: [size, CRC-32]}, "crc32": of the files' JSON}
METADATA = ".metadata"  # DCP's index of the shards (its name in torch's filesystem.py)
_CHUNK = 16 << 20  # CRC read size
_STEP = re.compile(r"step-\d+(\.1)?")  # what LATEST names (see _folder_name)
_SHARD = re.compile(r"__\d+_\d+\.distcp")  # DCP's shard files


class RefusedFile(ValueError):
    """A file of a sharded checkpoint that is not read: damaged, or asking for more than a
    checkpoint holds (the message names it and why)."""


def save(folder: str | os.PathLike[str], step: int, state: dict[str, Any], *,
         async_save: bool = False, before: Callable[[Path], None] | None = None
         ) -> Future[None] | None:
    """Write ``state`` as ``folder/step-<step>`` (every rank its shards; ``step-<step>.1``
    when ``LATEST`` names ``step-<step>`` already: a second save at one step never touches
    the complete one), record every file's checksum, then point ``LATEST`` at it. With
    ``async_save`` the shards are staged to CPU (before this returns) and written by a
    thread (``dcp.async_save``); the returned future completes after ``LATEST`` moved.
    ``before(target)`` runs on the coordinator once the target folder is made, before any
    shard is written (what only rank 0 writes into the same checkpoint).
    """
    import torch.distributed.checkpoint as dcp

    root = Path(folder)
    target = root / _folder_name(root, step)
    if _coordinator():
        root.mkdir(parents=True, exist_ok=True)
        if target.exists():  # a crashed attempt at the same step: never named by LATEST
            shutil.rmtree(target)
        target.mkdir()
        if before is not None:
            before(target)
    group = checkpoint_group()
    _barrier()
    if not async_save:
        with warnings.catch_warnings(), _naming_os_errors(target):  # as in load
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.save(state, storage_writer=_writer(target), no_dist=not _grouped(),
                     process_group=group)
        _record_sums(target)
        _publish(root, target.name)
        _barrier()  # no rank returns before LATEST names the new checkpoint
        return None
    # Its own process group: the writer thread's collectives (gathering the shards' write
    # results) run while training's run on the default group.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        # DCP's own writer: given one, async_save stages through it instead of its default
        # stager (which FSDP2's DTensors need), so another rank's failed write stays
        # DCP's error there; the rank whose write failed names the errno (finish).
        pending = dcp.async_save(state, checkpoint_id=str(target), no_dist=not _grouped(),
                                 process_group=group)
    done: Future[None] = Future()

    def finish(fut: Any) -> None:
        try:
            with _naming_os_errors(target):
                fut.result()
            _record_sums(target)
            _publish(root, target.name)
            _barrier()  # (on DCP's thread, still the group's only user)
            done.set_result(None)
        except BaseException as err:  # noqa: BLE001 - handed to whoever waits
            done.set_exception(err)

    pending.add_done_callback(finish)  # type: ignore[union-attr]
    return done


@contextmanager
def _naming_os_errors(target: Path) -> Iterator[None]:
    """Raise the ``OSError`` under DCP's errors (a full disk: ENOSPC, "No space left on
    device") naming ``target``.

    ``torch.save`` turns a failed write into "[enforce fail at inline_container.cc]
    unexpected pos", naming no file and no errno, and DCP wraps that in its
    ``CheckpointException``; the ``OSError`` is still there, as the context of torch's
    error (``failures`` holds each rank's).
    """
    try:
        yield
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        cause = _os_error_in(exc)
        if cause is None or cause.errno is None:
            raise
        raise OSError(cause.errno, cause.strerror, str(target)) from exc


def _writer(target: Path) -> Any:
    """DCP's ``FileSystemWriter`` of ``target`` whose failed write raises the ``OSError``
    naming ``target`` on the rank it failed on: DCP hands each rank's error to the others
    pickled, which drops the ``OSError`` that torch's error holds as its context."""
    from torch.distributed.checkpoint import FileSystemWriter

    class NamingWriter(FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            with _naming_os_errors(target):
                return super().write_data(plan, planner)

    return NamingWriter(target)


def _os_error_in(exc: BaseException | None, depth: int = 0) -> OSError | None:
    """The first ``OSError`` in ``exc``, its causes and contexts, and DCP's ``failures``."""
    if exc is None or depth > 16:
        return None
    if isinstance(exc, OSError):
        return exc
    failures = getattr(exc, "failures", None)
    inner = [f[0] if isinstance(f, tuple) else f for f in (
        failures.values() if isinstance(failures, dict) else ())]
    for candidate in (*inner, exc.__cause__, exc.__context__):
        if isinstance(candidate, BaseException) and (
                found := _os_error_in(candidate, depth + 1)) is not None:
            return found
    return None


def _folder_name(root: Path, step: int) -> str:
    """``step-<step>``, or ``step-<step>.1`` when ``LATEST`` names that, as the coordinator
    reads it: the same name on every rank (a broadcast)."""
    name: list[str | None] = [None]
    if _coordinator():
        base = f"step-{step}"
        try:
            current = latest(root)
        except RefusedFile:  # a damaged LATEST names nothing; this save replaces it
            current = None
        name = [base + ".1" if current == base else base]
    if _grouped():
        dist.broadcast_object_list(name, src=0, group=checkpoint_group())
    return str(name[0])


def latest(folder: str | os.PathLike[str]) -> str | None:
    """The name of the newest complete checkpoint in ``folder`` (``step-<n>``), or None
    when there is no ``LATEST`` file.

    Raises:
        RefusedFile: a ``LATEST`` that names no step folder (damaged: not ASCII, empty, or
            a path, which would lead the load out of the folder).
    """
    path = Path(folder) / LATEST
    try:
        data = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise RefusedFile(f"{path}: unreadable: {exc}") from exc
    name = data.decode("ascii", errors="replace").strip()
    if not _STEP.fullmatch(name):
        raise RefusedFile(f"{path}: damaged: holds {data[:40]!r}, not the name of a step "
                          f"folder (step-<n>)")
    return name


def load(folder: str | os.PathLike[str], state: dict[str, Any]) -> int:
    """Fill the whole tensors of ``state`` in place from the checkpoint ``LATEST`` names
    (DCP reshards the ranks' shards into them); returns its step. Every rank that calls it
    reads on its own (no collective). The files' checksums are not checked here:
    ``damaged_file`` checks them all; DCP's index is read by ``read_metadata``.

    Raises:
        FileNotFoundError: no complete checkpoint in ``folder``.
        RefusedFile: a damaged ``LATEST``, or an index that asks for more than shards.
    """
    import torch.distributed.checkpoint as dcp

    root = Path(folder)
    name = latest(root)
    if name is None:
        raise FileNotFoundError(f"path: no complete sharded checkpoint in {str(root)!r} (no "
                                f"{LATEST} file); expected a folder written by fitdp "
                                f"with strategy='fsdp'")
    reader = _checked_reader(root / name)
    with warnings.catch_warnings():  # one process is the intent, not a mistake to warn of
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(state, storage_reader=reader, no_dist=True)
    return int(name.removeprefix("step-").split(".")[0])


# What DCP's index holds (torch.distributed.checkpoint.metadata's dataclasses, the storage
# entries of its filesystem.py, and the torch values in them): the unpickler admits these
# names and nothing else. BytesStorageMetadata is left out on purpose: DCP loads such an
# entry with torch.load(weights_only=False), and fitdp writes tensors only.
_DCP = "torch.distributed.checkpoint."
_ADMITTED = {
    (_DCP + "metadata", "Metadata"), (_DCP + "metadata", "TensorStorageMetadata"),
    (_DCP + "metadata", "ChunkStorageMetadata"), (_DCP + "metadata", "TensorProperties"),
    (_DCP + "metadata", "MetadataIndex"), (_DCP + "metadata", "StorageMeta"),
    (_DCP + "metadata", "_MEM_FORMAT_ENCODING"), (_DCP + "filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _IndexUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` admitting only DCP's index types and torch dtypes (the recipe
    of the ``pickle`` docs, "Restricting Globals")."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) not in _ADMITTED:
            raise pickle.UnpicklingError(f"it asks for {module}.{name}, which is not part "
                                         f"of DCP's index of shards")
        return super().find_class(module, name)


def read_metadata(step: str | os.PathLike[str]) -> Any:
    """DCP's index of the shards of the step folder ``step`` (its ``Metadata``), read by an
    unpickler that admits only DCP's index types, and checked to ask DCP for nothing but
    tensors from this folder's shard files.

    Raises:
        RefusedFile: the file is missing, or holds anything else (the message names it).
    """
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorStorageMetadata,
    )

    path = Path(step) / METADATA
    try:
        with open(path, "rb") as f:
            index = _IndexUnpickler(f).load()
    except Exception as exc:  # a crafted or damaged pickle fails in many ways: all refused
        raise RefusedFile(f"{path}: refused: {exc}") from exc
    if type(index) is not Metadata or not isinstance(index.state_dict_metadata, dict) or (
            not isinstance(index.storage_data, dict)):
        raise RefusedFile(f"{path}: refused: not DCP's index of shards (Metadata)")
    for key, entry in index.state_dict_metadata.items():
        if not isinstance(key, str) or type(entry) is not TensorStorageMetadata:
            raise RefusedFile(f"{path}: refused: entry {key!r} is not a tensor")
    for where, info in index.storage_data.items():
        if type(where) is not MetadataIndex or type(info) is not _StorageInfo or (
                not isinstance(info.relative_path, str)
                or not _SHARD.fullmatch(info.relative_path)):
            raise RefusedFile(f"{path}: refused: a storage entry {info!r} that is not a "
                              f"shard file (__<rank>_<n>.distcp) of this folder")
        if info.transform_descriptors:  # fitdp writes plain torch.save records only
            raise RefusedFile(f"{path}: refused: {info.relative_path} is read through "
                              f"transforms {info.transform_descriptors!r}")
    if index.storage_meta is not None and type(index.storage_meta) is not StorageMeta:
        raise RefusedFile(f"{path}: refused: storage_meta is not DCP's StorageMeta")
    return index


def _checked_reader(step: Path) -> Any:
    """DCP's ``FileSystemReader`` of ``step`` that hands DCP the index ``read_metadata``
    read and checked (DCP's own ``read_metadata`` would ``pickle.load`` the file)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    index = read_metadata(step)

    class CheckedReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("rank") is not None:  # a rank's own index: fitdp writes none
                raise RefusedFile(f"{step}: no per-rank index is read")
            if index.storage_meta is None:  # as DCP's reader does
                index.storage_meta = StorageMeta()
            index.storage_meta.load_id = self.load_id
            return index

    return CheckedReader(step)


def _record_sums(target: Path) -> None:
    """Every rank sums the shard files it wrote (``__<rank>_<n>.distcp``, DCP's names); the
    coordinator sums the rest (DCP's ``.metadata``, rank 0's own files) and writes ``SUMS``
    atomically, the last file of the step."""
    rank = dist.get_rank(checkpoint_group()) if _grouped() else 0
    sums = {p.name: file_sum(p) for p in sorted(target.glob(f"__{rank}_*"))}
    if _grouped():
        every: list[Any] = [None] * dist.get_world_size(checkpoint_group())
        dist.gather_object(sums, every if _coordinator() else None, dst=0,
                           group=checkpoint_group())
        if _coordinator():
            sums = {k: v for part in every for k, v in part.items()}
    if not _coordinator():
        return
    for p in sorted(target.iterdir()):
        if p.is_file() and p.name not in sums:
            sums[p.name] = file_sum(p)
    body = {"files": sums, "crc32": zlib.crc32(json.dumps(sums, sort_keys=True).encode())}
    tmp = target / f".{SUMS}.tmp"
    with open(tmp, "w") as f:
        json.dump(body, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target / SUMS)


def file_sum(path: Path) -> list[int]:
    """``[size, CRC-32]`` of the file at ``path`` (``zlib``: no torch setting involved)."""
    crc, size = 0, 0
    buf = memoryview(bytearray(_CHUNK))
    with open(path, "rb", buffering=0) as f:
        while got := f.readinto(buf):
            crc, size = zlib.crc32(buf[:got], crc), size + got
    return [size, crc]


def damaged_file(step: str | os.PathLike[str]) -> str | None:
    """What is wrong with the checkpoint folder ``step`` (``folder/step-<n>``), naming the
    file: a missing, damaged or foreign ``SUMS``, a file it lists that is missing, of
    another size or another CRC-32, or a file in the folder it does not list. None when
    every file is as saved."""
    sums_path = Path(step) / SUMS
    try:
        files = _listed(json.loads(sums_path.read_text()))
    except FileNotFoundError:
        return (f"{sums_path}: missing: a step folder without it is incomplete, damaged or "
                f"not written by this fitdp")
    except (OSError, ValueError) as exc:
        return f"{sums_path}: damaged: {exc}"
    for name, (size, crc) in sorted(files.items()):
        path = Path(step) / name
        try:
            found = path.stat().st_size
            if found != size:
                return f"{path}: {found} bytes where {size} were written (truncated or replaced)"
            if file_sum(path)[1] != crc:
                return f"{path}: corrupted: its CRC-32 does not match the one recorded at save"
        except FileNotFoundError:
            return f"{path}: missing ({SUMS} lists it, {size} bytes)"
        except OSError as exc:
            return f"{path}: unreadable: {exc}"
    try:
        extra = sorted(set(os.listdir(step)) - set(files) - {SUMS})
    except OSError as exc:
        return f"{step}: unreadable: {exc}"
    if extra:
        return (f"{Path(step) / extra[0]}: not written by the save ({SUMS} does not list "
                f"it): a stray or copied-in file; a step folder holds exactly its files")
    return None


def _listed(body: Any) -> dict[str, list[int]]:
    """The ``{name: [size, CRC-32]}`` of a parsed ``SUMS`` file.

    Raises:
        ValueError: not what ``_record_sums`` writes (a name with a path in it included), or
            entries that do not match its own CRC-32.
    """
    files = body.get("files") if isinstance(body, dict) else None
    if not isinstance(files, dict) or body.get("crc32") != zlib.crc32(
            json.dumps(files, sort_keys=True).encode()):
        raise ValueError("its entries do not match its own CRC-32")
    for name, entry in files.items():
        if os.path.basename(name) != name or name in ("", ".", "..") or not (
                isinstance(entry, list) and len(entry) == 2
                and all(type(i) is int for i in entry)):
            raise ValueError(f"entry {name!r}: {entry!r} is not a file name and [size, CRC-32]")
    return files


def _publish(root: Path, name: str) -> None:
    """Name ``name`` as the newest complete checkpoint, then drop the older ones."""
    if not _coordinator():
        return
    tmp = root / f".{LATEST}.tmp"
    tmp.write_text(name)
    os.replace(tmp, root / LATEST)  # atomic: LATEST is the old name or the new one
    for old in root.glob("step-*"):
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)


def _grouped() -> bool:
    return dist.is_available() and dist.is_initialized()


def _coordinator() -> bool:
    return not _grouped() or dist.get_rank() == 0


def _barrier() -> None:
    if _grouped():
        dist.barrier(group=checkpoint_group())


_groups: dict[int, Any] = {}  # the default group's id -> the checkpoints' gloo group


def checkpoint_group() -> Any:
    """A gloo group of every rank for checkpoint collectives (made once per default group,
    on every rank at the same save), or None outside a process group. An async save's
    thread uses it until its future completes: the caller's thread must not use it before
    (collectives of two threads on one group may pair up wrongly)."""
    if not _grouped():
        return None
    key = id(dist.group.WORLD)
    if key not in _groups:
        _groups[key] = dist.new_group(backend="gloo")
    return _groups[key]


def nonfinite_names(state: dict[str, torch.Tensor]) -> list[str]:
    """The floating-point entries of ``state`` holding NaN or inf, with one host sync. FSDP2
    shards are checked where they are and the verdicts combined over the ranks (a collective
    every rank joins, of one flag per entry: no gather); plain tensors need no collective."""
    names = [k for k, t in state.items() if t.is_floating_point()]
    if not names:
        return []
    local = [t.to_local() if is_shard(t) else t for t in (state[k] for k in names)]
    shards = [t.device for t, k in zip(local, names) if is_shard(state[k])]
    # On the shards' device (NCCL takes no CPU tensor), else the first entry's.
    device = shards[0] if shards else local[0].device
    flags = torch.stack([(~torch.isfinite(t).all()).to(device) for t in local]).to(torch.uint8)
    if shards:  # the default group: the checkpoints' own may be busy in an async save
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [k for k, bad in zip(names, flags.tolist()) if bad]
