"""Files of the Batch API on disk (`conductor.batch_dir`/files): uploads, batch inputs and outputs.

1. `start()` creates the directory and removes uploads a stopped conductor left half-written (`*.part`).
2. An upload streams into `<id>.part` chunk by chunk, counting bytes against `max_bytes` (past it: 413, and the
   part file goes); `commit_upload` then fsyncs it, writes the metadata `<id>.json` atomically (temporary file,
   fsync, rename) and renames the data to `<id>.data`. `add_bytes` does the same for files the conductor makes
   (batch output and error files), under an id the caller may choose (so a retried finalization reuses it).
3. `get`, `data_path`, `list` and `delete` answer only the owner's files (the caller's API-key digest): another
   key's file is a 404, as a missing one.
Owns the files directory. A file's data and metadata are written once and never changed; delete removes both.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from mooncaked.api.errors import ApiError

FILE_ID_PATTERN = re.compile(r"^file-[A-Za-z0-9_-]{1,64}$")
CHUNK_BYTES = 1 << 16


class ChunkReader(Protocol):
    async def next_chunk(self, size: int) -> bytes:
        """The next chunk of at most `size` bytes (b"" at the end), within the body's deadline."""
        ...


@dataclass(frozen=True)
class FileInfo:
    file_id: str
    owner: str
    filename: str
    purpose: str
    num_bytes: int
    created_at: int  # unix seconds

    def as_json(self) -> dict[str, Any]:
        return {"id": self.file_id, "object": "file", "bytes": self.num_bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed", "status_details": None}


def file_not_found(file_id: str) -> ApiError:
    return ApiError(404, f"No file with id {file_id!r}: GET /v1/files lists the files of this API key.",
                    param="file_id", code="not_found")


def file_too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"The file is larger than {max_bytes} bytes (conductor.max_file_bytes); split it.",
                    param="file", code="file_too_large")


class FileStore:
    """See the module docstring."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        for leftover in self.directory.glob("*.part"):
            leftover.unlink(missing_ok=True)

    def new_id(self) -> str:
        return "file-" + uuid.uuid4().hex[:24]

    async def receive(self, reader: ChunkReader, file_id: str, max_bytes: int) -> int:
        """Stream an upload into `<file_id>.part`; its size. Past `max_bytes` the part file goes and 413 is raised."""
        part = self._path(file_id, ".part")
        num_bytes = 0
        try:
            with open(part, "wb") as out:
                while chunk := await reader.next_chunk(CHUNK_BYTES):
                    num_bytes += len(chunk)
                    if num_bytes > max_bytes:
                        raise file_too_large(max_bytes)
                    out.write(chunk)
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        return num_bytes

    def discard(self, file_id: str) -> None:
        self._path(file_id, ".part").unlink(missing_ok=True)

    def commit_upload(self, file_id: str, filename: str, purpose: str, owner: str, num_bytes: int) -> FileInfo:
        info = FileInfo(file_id, owner, filename, purpose, num_bytes, int(time.time()))
        part = self._path(file_id, ".part")
        _fsync_file(part)
        write_atomically(self._path(file_id, ".json"), json.dumps(asdict(info)).encode())
        os.replace(part, self._path(file_id, ".data"))
        fsync_dir(self.directory)
        return info

    def add_bytes(self, data: bytes, filename: str, purpose: str, owner: str, file_id: str | None = None) -> FileInfo:
        file_id = file_id or self.new_id()
        with open(self._path(file_id, ".part"), "wb") as out:
            out.write(data)
        return self.commit_upload(file_id, filename, purpose, owner, len(data))

    def get(self, file_id: str, owner: str) -> FileInfo:
        if not FILE_ID_PATTERN.match(file_id):
            raise file_not_found(file_id[:80])
        try:
            info = FileInfo(**json.loads(self._path(file_id, ".json").read_bytes()))
        except (OSError, ValueError, TypeError):
            raise file_not_found(file_id) from None
        if info.owner != owner or not self._path(file_id, ".data").exists():
            raise file_not_found(file_id)
        return info

    def data_path(self, file_id: str, owner: str) -> Path:
        self.get(file_id, owner)
        return self._path(file_id, ".data")

    def list(self, owner: str, purpose: str | None = None) -> list[FileInfo]:
        infos = []
        for meta in self.directory.glob("file-*.json"):
            try:
                infos.append(self.get(meta.stem, owner))
            except ApiError:
                continue
        return sorted((i for i in infos if purpose is None or i.purpose == purpose),
                      key=lambda i: (i.created_at, i.file_id))

    def delete(self, file_id: str, owner: str) -> None:
        self.get(file_id, owner)
        self._path(file_id, ".json").unlink(missing_ok=True)
        self._path(file_id, ".data").unlink(missing_ok=True)

    def _path(self, file_id: str, suffix: str) -> Path:
        assert FILE_ID_PATTERN.match(file_id), file_id
        return self.directory / (file_id + suffix)


def write_atomically(path: Path, data: bytes) -> None:
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, path)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

