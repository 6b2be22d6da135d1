"""The SSD tier's object files: their format, a durable write and a verified read (ssd.py owns the directory).

File layout: header (magic, version, key, payload length, xxh3_64 of the payload), then the payload. A file is
written whole or not at all (`write_object`: a temporary file fsync'd, renamed, the directory fsync'd), and read
only once its header and checksum hold (`read_object`).
"""

from __future__ import annotations

import os
import struct

import xxhash

_HEADER = struct.Struct("<4sH16sQQ")  # magic, version, key, payload length, xxh3_64(payload)
_MAGIC = b"MCKV"
_VERSION = 1
HEADER_BYTES = _HEADER.size
SUFFIX = ".blk"


def encode_header(key: bytes, payload: bytes | memoryview) -> bytes:
    return _HEADER.pack(_MAGIC, _VERSION, key, len(payload), xxhash.xxh3_64_intdigest(payload))


def read_object(path: str, key: bytes) -> tuple[bytes | None, str]:
    """The payload of the object file of `key` at `path` once its header and checksum hold, else (None, why)."""
    try:
        with open(path, "rb") as file:
            blob = file.read()
    except OSError as error:
        return None, str(error)
    if len(blob) < _HEADER.size:
        return None, "shorter than its header"
    magic, version, stored_key, length, checksum = _HEADER.unpack_from(blob)
    payload = memoryview(blob)[_HEADER.size :]
    if magic != _MAGIC or version != _VERSION or stored_key != key:
        return None, "bad header"
    if len(payload) != length:
        return None, f"torn: {len(payload)} of {length} payload bytes"
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        return None, "checksum mismatch"
    return bytes(payload), ""


def read_header_key(path: str) -> bytes | None:
    """The key of a plausible object file (header intact, size matches), else None."""
    try:
        with open(path, "rb") as file:
            header = file.read(_HEADER.size)
        size = os.path.getsize(path)
    except OSError:
        return None
    if len(header) != _HEADER.size:
        return None
    magic, version, key, length, _ = _HEADER.unpack(header)
    if magic != _MAGIC or version != _VERSION or size != _HEADER.size + length:
        return None
    return bytes(key)


def write_object(path: str, key: bytes, data: bytes | memoryview) -> None:
    """Write the object file of `key` whole or not at all, and durably: a temporary file fsync'd before its
    rename, then the directory fsync'd so that the rename survives a crash. On failure (OSError) the temporary
    file is removed."""
    temporary = path + ".tmp"
    try:
        with open(temporary, "wb") as file:
            file.write(encode_header(key, data))
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except OSError:
        unlink_quietly(temporary)
        raise
    directory_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory_fd)
    finally:
        os.close(directory_fd)


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
