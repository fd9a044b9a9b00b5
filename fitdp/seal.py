"""The seal: detects any damage to a checkpoint file before anything is unpickled.

A checkpoint is a plain ``torch.save`` zip. Its zip comment (the last field of a zip, which
readers skip) holds ``b"FITDPCK1"`` and the hex SHA-256 of every byte that is not record data:
headers, index and pickle framing, a few KB. Record data is covered by the CRC-32 that
torch.save stores per record but torch.load never checks. So sealing hashes only a few KB,
and verifying costs one CRC pass over the file.
"""

from __future__ import annotations

import hashlib
import io
import os
import struct
import zipfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

import torch


class CheckpointError(Exception):
    """A file that cannot be loaded safely as a fitdp checkpoint; the message names it and why."""


_SEAL_MAGIC = b"FITDPCK1"
_SEAL_LEN = len(_SEAL_MAGIC) + 64  # hex digest: ASCII can never contain the b"PK\5\6" EOCD tag
_EOCD_LEN = 22  # end-of-central-directory record without comment
_LOCAL_HEADER_LEN = 30
_CHUNK = 16 << 20  # CRC read size: big enough to run at memory speed, small enough to not matter


@contextmanager
def record_crcs_on() -> Iterator[None]:
    """Make torch.save store record CRC-32s; the seal relies on them (a global switch since 2.5)."""
    was_on = getattr(torch.serialization, "get_crc32_options", lambda: True)()
    if not was_on:
        torch.serialization.set_crc32_options(True)
    try:
        yield
    finally:
        if not was_on:
            torch.serialization.set_crc32_options(False)


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
        f.seek(start)
        actual, left = 0, size
        while left:
            got = f.readinto(buf[: min(left, _CHUNK)])
            if not got:
                raise CheckpointError(f"{path}: truncated inside record {name}")
            actual, left = zlib.crc32(buf[:got], actual), left - got
        if actual != crc:
            raise CheckpointError(f"{path}: corrupted: CRC-32 mismatch in record {name}")
