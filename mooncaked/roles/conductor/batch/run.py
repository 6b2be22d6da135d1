"""One batch run by this conductor, from validating to a terminal status (batches.py's lifecycle, steps 2 and 3).

1. run() opens the batch's journal; a batch found `finalizing` (a conductor stopped while writing its files)
   only finishes.
2. Validating: every line is parsed (on a worker thread) and prepared (tokenized on one too) up front; bad
   lines are answered at once in the journal, an empty or oversized file fails the batch. The valid lines not answered yet go to the manager's BatchQueue.
3. In progress: each answer (answer()) is journaled before it counts; the run wakes on every answer, a status
   change (cancel) and the batch's expiry, which answers the lines left `batch_expired`.
4. Finishing: the output and error files are written from the journal in line order, then the terminal status
   is saved.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from mooncaked.api.errors import ApiError
from mooncaked.api.file_store import FileStore
from mooncaked.api.tenants import Tenant
from mooncaked.config import Config
from mooncaked.roles.conductor.backend import ConductorBackend
from mooncaked.roles.conductor.batch import journal as bj
from mooncaked.roles.conductor.batch.journal import BatchRecord, Journal
from mooncaked.roles.conductor.batch.lines import BatchLine, LineError, error_line, failed_line, parse_input
from mooncaked.roles.conductor.batch.queue import BatchQueue, QueuedLine
from mooncaked.roles.conductor.frontend import ConductorRequest

logger = logging.getLogger(__name__)


class RunHost(Protocol):
    """What a run borrows from its manager (batches.BatchManager owns all of it)."""

    config: Config
    backend: ConductorBackend
    root: Path
    files: FileStore
    queue: BatchQueue
    tenant_of: Callable[[str], Tenant | None]


class BatchRun:
    """One batch being run by this conductor: owns its journal; borrows its record from the manager."""

    def __init__(self, manager: RunHost, record: BatchRecord, sequence: int) -> None:
        self.manager = manager
        self.record = record
        self.sequence = sequence  # batches created earlier go first among lines of equal priority
        self.journal: Journal | None = None
        self._changed = asyncio.Event()

    def set_status(self, status: str) -> None:
        self.record.status = status
        self.record.times[status] = int(time.time())
        bj.save_record(self.manager.root, self.record)
        self._changed.set()

    async def answer(self, number: int, is_ok: bool, line: dict[str, Any]) -> bool:
        assert self.journal is not None
        if await self.journal.append(number, is_ok, line):
            self._count()
            self._changed.set()
        return True

    async def run(self) -> None:
        record = self.record
        try:
            self.journal = Journal.open(bj.batch_path(self.manager.root, record.batch_id) / "journal.jsonl")
            if record.status == bj.FINALIZING:
                await self._finish(bj.COMPLETED)
                return
            lines = await self._validate()
            if lines is None:
                return
            await self._run_lines(lines)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("batch %s failed", record.batch_id)
            record.errors = [{"code": "internal_error", "message": f"the batch failed: {exc}", "param": None,
                              "line": None}]
            self.set_status(bj.FAILED)

    async def _validate(self) -> list[QueuedLine] | None:
        """Parse and prepare every line; answer the bad ones. None when the batch failed as a whole."""
        record, manager = self.record, self.manager
        data = await asyncio.to_thread(bj.input_path(manager.root, record.batch_id).read_bytes)
        tenant = manager.tenant_of(record.tenant_id) if record.tenant_id else None
        parsed = await asyncio.to_thread(parse_input, data, batch_id=record.batch_id, endpoint=record.endpoint,
                                         model_ids=manager.backend.model_ids(), client_id=record.owner, tenant=tenant)
        problem = _file_problem(parsed, manager.config.conductor.max_batch_lines)
        if problem:
            record.errors = [{"code": problem[0], "message": problem[1], "param": "input_file_id", "line": None}]
            self.set_status(bj.FAILED)
            return None
        record.total = len(parsed)
        queued: list[QueuedLine] = []
        for line in parsed:
            item = await self._prepare(line)
            if item is not None:
                queued.append(item)
            await asyncio.sleep(0)  # a file of many lines must not starve interactive requests
        self._count()
        if record.status == bj.VALIDATING:
            self.set_status(bj.IN_PROGRESS)
        return queued

    async def _prepare(self, line: BatchLine | LineError) -> QueuedLine | None:
        assert self.journal is not None
        if line.number in self.journal.answered:
            return None
        if isinstance(line, LineError):
            await self.journal.append(line.number, False, error_line(line))
            return None
        try:
            prepared = await self.manager.backend.prepare(line.request)
        except ApiError as error:
            await self.journal.append(line.number, False, failed_line(line, error))
            return None
        assert isinstance(prepared, ConductorRequest)
        rank = (line.request.priority, self.sequence, line.number)
        return QueuedLine(rank, self.record.batch_id, line, prepared)

    async def _run_lines(self, queued: list[QueuedLine]) -> None:
        record, queue = self.record, self.manager.queue
        if record.status == bj.IN_PROGRESS:
            queue.submit(queued)
        while record.status == bj.IN_PROGRESS and record.completed + record.failed < record.total:
            self._changed.clear()
            left_s = record.expires_at - time.time()
            if left_s <= 0:
                await queue.withdraw(record.batch_id)
                await self._expire(queued)
                return
            try:
                async with asyncio.timeout(left_s):
                    await self._changed.wait()
            except TimeoutError:
                pass
        await queue.withdraw(record.batch_id)
        if record.status == bj.CANCELLING:
            await self._finish(bj.CANCELLED)
        elif record.status == bj.IN_PROGRESS:
            self.set_status(bj.FINALIZING)
            await self._finish(bj.COMPLETED)

    async def _expire(self, queued: list[QueuedLine]) -> None:
        for item in queued:
            error = LineError(item.line.number, item.line.custom_id, "batch_expired",
                              "This line was not run before the batch expired (completion_window).")
            await self.answer(item.line.number, False, error_line(error))
        await self._finish(bj.EXPIRED)

    async def _finish(self, status: str) -> None:
        """Write the output and error files from the journal (line order), then enter `status`."""
        record, files = self.record, self.manager.files
        assert self.journal is not None
        entries = sorted(self.journal.entries, key=lambda e: e.number)
        self._count()
        for is_ok, kind in ((True, "output"), (False, "errors")):
            lines = [_json_line(e.record) for e in entries if e.is_ok == is_ok]
            if not lines:
                continue
            file_id = f"file-{record.batch_id.removeprefix('batch_')}-{kind}"
            await asyncio.to_thread(files.add_bytes, b"".join(lines), f"{record.batch_id}_{kind}.jsonl",
                                    "batch_output", record.owner, file_id)
            if is_ok:
                record.output_file_id = file_id
            else:
                record.error_file_id = file_id
        self.set_status(status)
        logger.info("batch %s %s: %d completed, %d failed of %d", record.batch_id, status, record.completed,
                    record.failed, record.total)

    def _count(self) -> None:
        assert self.journal is not None
        self.record.completed = sum(1 for e in self.journal.entries if e.is_ok)
        self.record.failed = len(self.journal.entries) - self.record.completed


def _file_problem(parsed: list[BatchLine | LineError], max_lines: int) -> tuple[str, str] | None:
    if not parsed:
        return "empty_file", "The input file has no request line; each line is one JSON request."
    if len(parsed) > max_lines:
        return "too_many_lines", f"The input file has {len(parsed)} lines; at most {max_lines} " \
                                 "(conductor.max_batch_lines)."
    return None


def _json_line(record: dict[str, Any]) -> bytes:
    return json.dumps(record).encode() + b"\n"

