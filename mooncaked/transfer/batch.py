"""Batch records: progress and outcome of one submitted batch.

1. `submit` creates a record with the batch's total byte count.
2. Transport threads report bytes done (`add_done`) or a failure (`fail`); the first failure wins.
3. The record signals its asyncio event on the engine's loop when it finishes; `wait` awaits it.
4. `wait` removes the record from the table (the batch id is then unknown).
"""

from __future__ import annotations

import asyncio
import threading

from mooncaked.transfer.types import BatchState, BatchStatus


class BatchRecord:
    """Owned by the engine's BatchTable; mutated under `_lock` by transport threads."""

    def __init__(self, batch_id: int, num_bytes_total: int, loop: asyncio.AbstractEventLoop) -> None:
        self.batch_id = batch_id
        self.num_bytes_total = num_bytes_total
        self.num_bytes_done = 0
        self.state = BatchState.PENDING
        self.error: str | None = None
        self.finished = asyncio.Event()
        self._loop = loop
        self._lock = threading.Lock()
        if num_bytes_total == 0:
            self.state = BatchState.DONE
            self.finished.set()

    @property
    def is_finished(self) -> bool:
        return self.state is not BatchState.PENDING

    def add_done(self, num_bytes: int) -> None:
        with self._lock:
            if self.state is not BatchState.PENDING:
                return
            self.num_bytes_done += num_bytes
            assert self.num_bytes_done <= self.num_bytes_total, "more bytes done than submitted"
            if self.num_bytes_done < self.num_bytes_total:
                return
            self.state = BatchState.DONE
        self._signal()

    def fail(self, error: str) -> None:
        with self._lock:
            if self.state is not BatchState.PENDING:
                return
            self.state = BatchState.FAILED
            self.error = f"batch {self.batch_id}: {error}"
        self._signal()

    def status(self) -> BatchStatus:
        with self._lock:
            return BatchStatus(self.state, self.num_bytes_done, self.error, self.num_bytes_total)

    def _signal(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self.finished.set)
        except RuntimeError:
            pass  # the loop is closed: nobody can be waiting any more


class BatchTable:
    """Owns the live batch records of one engine, by id."""

    def __init__(self) -> None:
        self._records: dict[int, BatchRecord] = {}
        self._next_id = 1

    def create(self, num_bytes_total: int, loop: asyncio.AbstractEventLoop) -> BatchRecord:
        record = BatchRecord(self._next_id, num_bytes_total, loop)
        self._records[record.batch_id] = record
        self._next_id += 1
        return record

    def get(self, batch_id: int) -> BatchRecord:
        record = self._records.get(batch_id)
        if record is None:
            raise KeyError(f"unknown batch id {batch_id}: never submitted, or already waited for")
        return record

    def pop(self, batch_id: int) -> None:
        self._records.pop(batch_id, None)

    def pending_events(self) -> list[asyncio.Event]:
        return [record.finished for record in self._records.values() if not record.is_finished]

    def fail_all(self, error: str) -> None:
        for record in self._records.values():
            record.fail(error)
