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
   `expired`. (roles/conductor/batch/run.py runs steps 2 and 3.)
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
from mooncaked.roles.conductor.backend import ConductorBackend
from mooncaked.roles.conductor.batch import journal as bj
from mooncaked.roles.conductor.batch.journal import BatchRecord
from mooncaked.roles.conductor.batch.lines import failed_line, output_line
from mooncaked.roles.conductor.batch.queue import BatchQueue, QueuedLine
from mooncaked.roles.conductor.batch.run import BatchRun
from mooncaked.roles.conductor.completion import complete_prepared
from mooncaked.roles.conductor.view.cluster import ClusterView
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
