"""The seal: detects any damage to a checkpoint file before anything is unpickled.

A checkpoint is a plain ``torch.save`` zip. Its zip comment (the last field of a zip, which
readers skip) holds ``b"FITDPCK1"`` and the hex SHA-256 of every byte that is not record data:
headers, index and pickle framing, a few KB. Record data is covered by the per-record CRC-32 of
the zip format, which torch.load never checks. So sealing hashes only a few KB, and verifying
costs one CRC pass over the file.

torch.save writes those CRCs itself unless its CRC option is off. That option is
process-wide and the user's, so fitdp never switches it: when it is off, ``write_sealed``
computes the CRCs as torch.save streams each tensor's bytes through and writes them in.
"""

from __future__ import annotations

import hashlib
import io
import os
import struct
import zipfile
import zlib
from typing import IO, Any, cast

import torch


class CheckpointError(Exception):
    """A file that cannot be loaded safely as a fitdp checkpoint; the message names it and why."""


_SEAL_MAGIC = b"FITDPCK1"
_SEAL_LEN = len(_SEAL_MAGIC) + 64  # hex digest: ASCII can never contain the b"PK\5\6" EOCD tag
_EOCD_LEN = 22  # end-of-central-directory record without comment
_LOCAL_HEADER_LEN = 30
_CHUNK = 16 << 20  # CRC read size: big enough to run at memory speed, small enough to not matter
_CRC_PASSING = 1 << 16  # writes this big get their CRC as they pass; smaller records are reread
_WRITEBACK = 32 << 20  # start writing to disk every 32 MB while saving


def write_sealed(f: IO[bytes], obj: Any) -> None:
    """``torch.save(obj)`` into the empty file ``f``, with every record CRC-32 set, then sealed.

    Args:
        f: an empty file open for reading and writing (binary, seekable).
        obj: what torch.save writes.
    """
    stream = _RecordStream(f, crcs=not _torch_writes_crcs())
    try:
        torch.save(obj, cast(IO[bytes], stream))  # write+flush suffice
    except RuntimeError:
        # torch reports a failed write (a full disk) as "[enforce fail at
        # inline_container.cc] unexpected pos", naming neither the errno nor the cause.
        if stream.error is None:
            raise
        raise stream.error from None
    f.flush()
    _fill_record_crcs(f, stream.crcs)
    seal(f)


def _torch_writes_crcs() -> bool:
    """Whether torch.save computes record CRC-32s now (an option since torch 2.5; earlier
    versions always do). Read, never set: another thread may be saving under it."""
    get = getattr(torch.serialization, "get_crc32_options", None)
    return True if get is None else bool(get())


class _RecordStream:
    """What torch.save writes to: with ``crcs``, notes the CRC-32 of each large write (torch
    hands over each tensor's bytes as one memoryview, no copy) and, every ``_WRITEBACK`` bytes,
    asks the kernel to start writing to disk, so the final fsync has little left to wait for."""

    def __init__(self, f: IO[bytes], crcs: bool) -> None:
        self.f = f
        self.take_crcs = crcs
        self.pos = self.flushed = f.tell()
        self.crcs: dict[int, tuple[int, int]] = {}  # offset -> (size, CRC-32)
        self.error: OSError | None = None  # the failed write torch.save's error hides

    def write(self, data: Any) -> int:
        view = memoryview(data)
        size = view.nbytes
        if self.take_crcs and size >= _CRC_PASSING:
            self.crcs[self.pos] = (size, zlib.crc32(view))  # releases the GIL
        try:
            self.f.write(view)
            self.pos += size
            if self.pos - self.flushed >= _WRITEBACK and hasattr(os, "posix_fadvise"):
                self.f.flush()
                # DONTNEED on dirty pages starts their writeback without waiting for it.
                os.posix_fadvise(self.f.fileno(), self.flushed, self.pos - self.flushed,
                                 os.POSIX_FADV_DONTNEED)
                self.flushed = self.pos
        except OSError as exc:
            self.error = exc
            raise
        return size

    def flush(self) -> None:
        try:
            self.f.flush()
        except OSError as exc:
            self.error = exc
            raise


def _fill_record_crcs(f: IO[bytes], passed: dict[int, tuple[int, int]]) -> None:
    """Write the CRC-32 of each record torch.save left at 0 into its data descriptor (or local
    header) and its central directory entry; records not seen whole in ``passed`` are read back.
    (A record whose true CRC is 0 is read back too, and keeps 0.)"""
    with zipfile.ZipFile(f) as archive:
        infos, pos = archive.infolist(), archive.start_dir
    patches = []
    for info in infos:
        f.seek(pos)
        entry = f.read(46)
        if len(entry) != 46 or entry[:4] != b"PK\x01\x02":
            raise RuntimeError("torch.save wrote an unexpected zip layout; cannot seal it")
        name_len, extra_len, comment_len = struct.unpack("<HHH", entry[28:34])
        entry_pos, pos = pos, pos + 46 + name_len + extra_len + comment_len
        if info.CRC:  # torch.save computed it
            continue
        start = _data_start(f, info)
        size, crc = passed.get(start, (-1, 0))
        if size != info.compress_size:
            crc = _crc_of(f, start, info.compress_size)
        packed = struct.pack("<I", crc)
        patches.append((entry_pos + 16, packed))
        if info.flag_bits & 0x08:  # CRC in the data descriptor after the data
            end = start + info.compress_size
            f.seek(end)
            patches.append((end + 4 if f.read(4) == b"PK\x07\x08" else end, packed))
        else:
            patches.append((info.header_offset + 14, packed))
    for offset, packed in patches:
        f.seek(offset)
        f.write(packed)
    f.flush()


def _data_start(f: IO[bytes], info: zipfile.ZipInfo) -> int:
    """Offset of the first data byte of the record ``info``."""
    f.seek(info.header_offset)
    local = f.read(_LOCAL_HEADER_LEN)
    if len(local) != _LOCAL_HEADER_LEN or local[:4] != b"PK\x03\x04":
        raise ValueError(f"bad local header for record {info.filename}")
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    return info.header_offset + _LOCAL_HEADER_LEN + name_len + extra_len


def _crc_of(f: IO[bytes], start: int, size: int, buf: memoryview | None = None) -> int:
    """CRC-32 of ``size`` bytes of ``f`` from ``start``, read through ``buf`` (>= 1 byte)."""
    if buf is None:
        buf = memoryview(bytearray(max(1, min(size, _CHUNK))))
    f.seek(start)
    crc, left = 0, size
    while left:
        got = f.readinto(buf[: min(left, len(buf))])  # type: ignore[attr-defined]
        if not got:
            raise ValueError(f"truncated record at offset {start}")
        crc, left = zlib.crc32(buf[:got], crc), left - got
    return crc


def _record_spans(f: IO[bytes], payload_end: int) -> list[tuple[str, int, int, int]]:
    """(name, data start, data size, CRC-32) of each zip record, sorted by offset."""
    spans = []
    with zipfile.ZipFile(f) as archive:
        for info in archive.infolist():
            if info.compress_type != zipfile.ZIP_STORED:
                raise ValueError(f"record {info.filename} is compressed")
            spans.append((info.filename, _data_start(f, info), info.compress_size, info.CRC))
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


def seal(f: IO[bytes]) -> None:
    """Append the seal to the fresh torch.save zip in ``f`` as the zip comment."""
    end = f.seek(0, os.SEEK_END)
    f.seek(end - _EOCD_LEN)
    eocd = f.read(_EOCD_LEN)
    if eocd[:4] != b"PK\x05\x06" or eocd[-2:] != b"\0\0":
        raise RuntimeError("torch.save wrote an unexpected zip layout; cannot seal it")
    digest = _structure_digest(f, _record_spans(f, end), end)
    f.seek(end - 2)
    f.write(struct.pack("<H", _SEAL_LEN) + _SEAL_MAGIC + digest.encode("ascii"))


def verify(f: io.BufferedReader, path: str) -> None:
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
        try:
            actual = _crc_of(f, start, size, buf)
        except ValueError as exc:
            raise CheckpointError(f"{path}: truncated inside record {name}") from exc
        if actual != crc:
            raise CheckpointError(f"{path}: corrupted: CRC-32 mismatch in record {name}")
