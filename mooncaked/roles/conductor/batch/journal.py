"""A batch's durable state in `conductor.batch_dir`/batches/<id>/: its record, its input, its journal.

1. `BatchRecord` is the OpenAI batch object (status, timestamps, request counts, file ids, errors) plus its
   owner; `save_record` replaces `batch.json` atomically on every status change, `load_records` reads them all
   back when a conductor starts.
2. The input file is linked (or copied) to `input.jsonl` when the batch is created, so deleting the uploaded file
   does not break a batch that still runs or resumes.
3. `Journal` holds every answered line: one JSON line `{"line": n, "ok": bool, "record": {...}}` appended with a
   single write and fsync'd before the line counts as answered. `Journal.open` reads it back first, cutting a
   torn last line (a conductor killed mid-write): what it lists was answered, and is never run again.
Owned by the batch's `BatchRun` (roles/conductor/batch/run.py), one writer per batch.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mooncaked.api.file_store import fsync_dir, write_atomically

logger = logging.getLogger(__name__)

VALIDATING, IN_PROGRESS, FINALIZING, COMPLETED = "validating", "in_progress", "finalizing", "completed"
FAILED, EXPIRED, CANCELLING, CANCELLED = "failed", "expired", "cancelling", "cancelled"
TERMINAL = frozenset({COMPLETED, FAILED, EXPIRED, CANCELLED})


@dataclass
class BatchRecord:
    """The batch object as OpenAI's API shows it, and who owns it (state of its BatchRun)."""

    batch_id: str
    owner: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    metadata: dict[str, str] | None = None
    status: str = VALIDATING
    times: dict[str, int] = field(default_factory=dict)  # status -> when it was entered (in_progress_at, ...)
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, Any]] | None = None
    total: int = 0
    completed: int = 0
    failed: int = 0
    tenant_id: str = ""  # the creator's tenant: its lines share KV and count as that tenant's

    def as_json(self) -> dict[str, Any]:
        stamps = {f"{status}_at": self.times.get(status) for status in
                  (IN_PROGRESS, FINALIZING, COMPLETED, FAILED, EXPIRED, CANCELLING, CANCELLED)}
        return {"id": self.batch_id, "object": "batch", "endpoint": self.endpoint,
                "errors": None if self.errors is None else {"object": "list", "data": self.errors},
                "input_file_id": self.input_file_id, "completion_window": self.completion_window,
                "status": self.status, "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
                "created_at": self.created_at, "expires_at": self.expires_at, **stamps,
                "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
                "metadata": self.metadata}


def batch_path(root: Path, batch_id: str) -> Path:
    return root / batch_id


def save_record(root: Path, record: BatchRecord) -> None:
    write_atomically(batch_path(root, record.batch_id) / "batch.json", json.dumps(asdict(record)).encode())


def load_records(root: Path) -> list[BatchRecord]:
    records = []
    for path in sorted(root.glob("batch_*/batch.json")):
        try:
            records.append(BatchRecord(**json.loads(path.read_bytes())))
        except (OSError, ValueError, TypeError) as exc:
            logger.error("batch state %s is unreadable (%s); that batch is skipped", path, exc)
    return records


def keep_input(root: Path, batch_id: str, source: Path) -> None:
    """Give the batch its own hard link (or copy) of the input file."""
    directory = batch_path(root, batch_id)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / "input.jsonl"
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)
    fsync_dir(directory)


def input_path(root: Path, batch_id: str) -> Path:
    return batch_path(root, batch_id) / "input.jsonl"


@dataclass(frozen=True)
class JournalEntry:
    number: int
    is_ok: bool
    record: dict[str, Any]


class Journal:
    """The append-only journal of one batch's answered lines; owned by its BatchRun."""

    def __init__(self, path: Path, entries: list[JournalEntry]) -> None:
        self.path = path
        self.entries = entries
        self.answered = {entry.number for entry in entries}
        self._lock = asyncio.Lock()

    @classmethod
    def open(cls, path: Path) -> Journal:
        data = path.read_bytes() if path.exists() else b""
        complete = data[: data.rfind(b"\n") + 1]
        if len(complete) != len(data):
            logger.warning("batch journal %s: a torn last line (%d bytes) is cut; that line runs again", path,
                           len(data) - len(complete))
            with open(path, "r+b") as out:
                out.truncate(len(complete))
                os.fsync(out.fileno())
        entries = []
        for raw in complete.splitlines():
            item = json.loads(raw)
            entries.append(JournalEntry(int(item["line"]), bool(item["ok"]), item["record"]))
        return cls(path, entries)

    async def append(self, number: int, is_ok: bool, record: dict[str, Any]) -> bool:
        """Record line `number` as answered; False (nothing written) when it already was."""
        async with self._lock:
            if number in self.answered:
                return False
            line = json.dumps({"line": number, "ok": is_ok, "record": record}).encode() + b"\n"
            self.answered.add(number)  # first: a cancelled caller leaves the write to finish in its thread
            self.entries.append(JournalEntry(number, is_ok, record))
            await asyncio.to_thread(_append_synced, self.path, line)
            return True


def _append_synced(path: Path, line: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)
