"""The Batch API (OpenAI's): batches of completion requests run in the batch class, durable across restarts.

A batch's life (statuses as OpenAI's):
1. `create_batch` checks the request (input file of purpose "batch", an endpoint, completion window "24h",
   metadata), gives the batch its own link to the input file, saves its record (`validating`) and starts its
   `BatchRun`.
2. validating: every line is parsed and prepared (tokenized, context checked) up front; a bad line is answered
   at once in the error file with its line number; an empty or oversized file fails the batch (`failed`,
   `errors`). Then `in_progress`: the valid lines not answered yet go to the `BatchQueue`, which starts them
   as interactive work leaves room. Each answer is journaled (fsync'd) before it counts.
3. When every line is answered: `finalizing` (output and error files written from the journal, in line order),
   then `completed`. Cancel: `cancelling` (running lines cancelled, waiting ones dropped), files of what was
   answered, `cancelled`. Past `expires_at`: the lines left are answered `batch_expired` in the error file,
   `expired`.
4. A conductor that stops cancels its running lines (not answered: not journaled); the next one to start on
   the same `conductor.batch_dir` resumes every unfinished batch from its journal, so no answered line runs
   twice and every line is answered once.
The BatchManager owns the file store, the queue, the runs, every batch record and the lock that keeps a second
conductor off the same batch_dir; a BatchRun owns its journal.
"""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mooncaked.api.batch_routes import BatchCreate, batch_not_found
from mooncaked.api.errors import ApiError, internal_error
from mooncaked.api.file_store import FileStore
from mooncaked.api.tenants import Tenant
from mooncaked.config import Config
from mooncaked.roles.conductor import batch_journal as bj
from mooncaked.roles.conductor.backend import ConductorBackend
from mooncaked.roles.conductor.batch_journal import BatchRecord, Journal
from mooncaked.roles.conductor.batch_lines import BatchLine, LineError, error_line, failed_line, output_line
from mooncaked.roles.conductor.batch_lines import parse_input
from mooncaked.roles.conductor.batch_queue import BatchQueue, QueuedLine
from mooncaked.roles.conductor.cluster_view import ClusterView
from mooncaked.roles.conductor.completion import complete_prepared
from mooncaked.roles.conductor.frontend import ConductorRequest
from mooncaked.sched.priority import BatchGate

logger = logging.getLogger(__name__)

WINDOW_S = {"24h": 86_400}
RETRIED_STATUSES = (429, 503)  # refused for load or no instance up: the line waits and runs later


class BatchManager:
    """See the module docstring."""

    def __init__(self, config: Config, backend: ConductorBackend, view: ClusterView, root: Path,
                 tenant_of: Callable[[str], Tenant | None] = lambda tenant_id: None) -> None:
        section = config.conductor
        self.tenant_of = tenant_of  # a tenant by id, as the tenants file says now
        self.config = config
        self.backend = backend
        self.root = root / "batches"
        self.files = FileStore(root / "files")
        gate = BatchGate(section.batch_max_in_flight, section.batch_slo_margin, section.batch_backoff_s)
        self.queue = BatchQueue(view, gate, self._serve, section.load_poll_interval_s, backend.class_metrics)
        self.records: dict[str, BatchRecord] = {}
        self.runs: dict[str, BatchRun] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._num_created = 0
        self._lock_fd: int | None = None

    async def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock_dir()
        self.files.start()
        await self.queue.start()
        for record in bj.load_records(self.root):
            self.records[record.batch_id] = record
            if record.status not in bj.TERMINAL:
                logger.info("resuming batch %s (%s)", record.batch_id, record.status)
                self._start_run(record)

    async def stop(self) -> None:
        await self.queue.stop()
        tasks, self._tasks = list(self._tasks), set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def _lock_dir(self) -> None:
        """One conductor per batch_dir: two would run the same batches (and answer their lines twice)."""
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise RuntimeError(f"conductor.batch_dir {self.root.parent} is in use by another conductor; give each "
                               "conductor its own batch_dir") from None
        self._lock_fd = fd

    def interactive_rejected(self) -> None:
        self.queue.interactive_rejected(time.monotonic())

    # ---- the API -----------------------------------------------------------------------------------------
    async def create_batch(self, spec: BatchCreate) -> dict[str, Any]:
        source = self.files.data_path(spec.input_file_id, spec.owner)
        if self.files.get(spec.input_file_id, spec.owner).purpose != "batch":
            raise ApiError(400, f"input_file_id: file {spec.input_file_id} was not uploaded with purpose \"batch\"",
                           param="input_file_id")
        now = int(time.time())
        record = BatchRecord("batch_" + uuid.uuid4().hex, spec.owner, spec.endpoint, spec.input_file_id,
                             spec.completion_window, now, now + WINDOW_S[spec.completion_window], spec.metadata,
                             tenant_id=spec.tenant_id)
        bj.keep_input(self.root, record.batch_id, source)
        bj.save_record(self.root, record)
        self.records[record.batch_id] = record
        self._start_run(record)
        logger.info("batch %s created from %s (%s)", record.batch_id, spec.input_file_id, spec.endpoint)
        return record.as_json()

    def get_batch(self, batch_id: str, owner: str) -> dict[str, Any]:
        return self._owned(batch_id, owner).as_json()

    def list_batches(self, owner: str, limit: int, after: str | None) -> tuple[list[dict[str, Any]], bool]:
        mine = sorted((r for r in self.records.values() if r.owner == owner),
                      key=lambda r: (r.created_at, r.batch_id), reverse=True)
        if after is not None:
            ids = [r.batch_id for r in mine]
            mine = mine[ids.index(after) + 1:] if after in ids else []
        return [r.as_json() for r in mine[:limit]], len(mine) > limit

    async def cancel_batch(self, batch_id: str, owner: str) -> dict[str, Any]:
        record = self._owned(batch_id, owner)
        run = self.runs.get(batch_id)
        if record.status in (bj.VALIDATING, bj.IN_PROGRESS) and run is not None:
            run.set_status(bj.CANCELLING)
        return record.as_json()

    def _owned(self, batch_id: str, owner: str) -> BatchRecord:
        record = self.records.get(batch_id)
        if record is None or record.owner != owner:
            raise batch_not_found(batch_id)
        return record

    # ---- runs --------------------------------------------------------------------------------------------
    def _start_run(self, record: BatchRecord) -> None:
        self._num_created += 1
        run = BatchRun(self, record, self._num_created)
        self.runs[record.batch_id] = run
        task = asyncio.create_task(run.run(), name=f"batch-{record.batch_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, queued: QueuedLine) -> bool:
        run = self.runs[queued.batch_id]
        prepared = dataclasses.replace(queued.prepared, arrival_time=time.monotonic())
        try:
            body = await complete_prepared(self.backend, prepared, self.config.conductor.request_timeout_s)
        except ApiError as error:
            if error.status in RETRIED_STATUSES:
                return False
            return await run.answer(queued.line.number, False, failed_line(queued.line, error))
        except Exception:
            logger.exception("batch line %s failed", queued.line.custom_id)
            failure = internal_error("The line failed inside the conductor.")
            return await run.answer(queued.line.number, False, failed_line(queued.line, failure))
        return await run.answer(queued.line.number, True, output_line(queued.line, body))


class BatchRun:
    """One batch being run by this conductor: owns its journal; borrows its record from the manager."""

    def __init__(self, manager: BatchManager, record: BatchRecord, sequence: int) -> None:
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
        parsed = parse_input(data, batch_id=record.batch_id, endpoint=record.endpoint,
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
            await asyncio.sleep(0)  # tokenizing a large file must not starve interactive requests
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

