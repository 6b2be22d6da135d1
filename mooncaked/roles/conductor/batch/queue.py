"""The conductor's queue of batch lines: the batch class fills the capacity interactive work leaves.

1. `submit` queues prepared lines of every batch in one heap, ordered by the line's `priority`, then its batch's
   creation, then its line number (sched/priority.py orders the classes on the workers).
2. The dispatch task starts the head line when `batch_admission` allows it (fewer than batch_max_in_flight
   running, no interactive rejection within batch_backoff_s, and the placement the line would get now predicts
   TTFT and TBT within batch_slo_margin of their SLOs); otherwise it looks again every `poll_s` or when a line
   ends. A line the cluster refuses (429, 503) goes back to the queue: batch lines wait, never fail for load.
3. Yield first: an interactive request rejected for load (`interactive_rejected`) pauses dispatch for the back-off
   and preempts the youngest running line, which is cancelled everywhere and queued again (it was not answered:
   it runs again from its start, reusing the prefix KV the stores hold).
4. `withdraw(batch_id)` drops a batch's waiting lines and cancels its running ones (cancel, expiry); `stop()`
   cancels everything (a restarted conductor runs again what was not answered).
Owns the heap, the running line tasks and the dispatch task (supervised: an unexpected exception is logged and
dispatch restarts; runtime/supervised.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from mooncaked.roles.conductor.batch.lines import BatchLine
from mooncaked.roles.conductor.class_metrics import ClassMetrics
from mooncaked.roles.conductor.frontend import ConductorRequest
from mooncaked.roles.conductor.view.cluster import ClusterView
from mooncaked.runtime.supervised import start_supervised
from mooncaked.sched.priority import BatchGate, batch_admission
from mooncaked.sched.types import RequestInfo

logger = logging.getLogger(__name__)


@dataclass(order=True)
class QueuedLine:
    rank: tuple[int, int, int]  # (priority, batch sequence, line number): smaller starts first
    batch_id: str = field(compare=False)
    line: BatchLine = field(compare=False)
    prepared: ConductorRequest = field(compare=False)

    def info(self, now: float) -> RequestInfo:
        prepared = self.prepared
        return RequestInfo(prepared.request_id, prepared.num_prompt_tokens, prepared.block_keys, now)


Serve = Callable[[QueuedLine], Awaitable[bool]]  # True: answered (journaled); False: refused for load, queue again


class BatchQueue:
    """See the module docstring."""

    def __init__(self, view: ClusterView, gate: BatchGate, serve: Serve, poll_s: float,
                 metrics: ClassMetrics) -> None:
        self.view = view
        self.metrics = metrics
        self.gate = gate
        self.serve = serve
        self.poll_s = poll_s
        self._heap: list[QueuedLine] = []
        self._running: dict[asyncio.Task[None], QueuedLine] = {}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._last_rejection: float | None = None
        self._held_until = 0.0
        self._starts = itertools.count()
        self._started_at: dict[asyncio.Task[None], int] = {}
        self.last_wait_reason = ""
        self.num_preempted = 0
        self.num_refused = 0

    @property
    def num_waiting(self) -> int:
        return len(self._heap)

    @property
    def num_running(self) -> int:
        return len(self._running)

    async def start(self) -> None:
        self._task = start_supervised("batch-dispatch", self._dispatch)

    async def stop(self) -> None:
        tasks = [*self._running, *([self._task] if self._task is not None else [])]
        self._task = None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._heap = []

    def submit(self, lines: Iterable[QueuedLine]) -> None:
        for line in lines:
            heapq.heappush(self._heap, line)
        self._wakeup.set()

    async def withdraw(self, batch_id: str) -> None:
        self._heap = [q for q in self._heap if q.batch_id != batch_id]
        heapq.heapify(self._heap)
        tasks = [task for task, q in self._running.items() if q.batch_id == batch_id]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def interactive_rejected(self, now: float) -> None:
        """Interactive work was turned away for load: pause dispatch and preempt the youngest running line."""
        self._last_rejection = now
        if not self._started_at:
            return
        youngest = max(self._started_at, key=lambda task: self._started_at[task])
        del self._started_at[youngest]
        self.num_preempted += 1
        self.metrics.batch_preemptions_total.inc()
        logger.info("preempting batch line %s: interactive work was rejected", self._running[youngest].line.custom_id)
        youngest.cancel()

    # ---- dispatch ----------------------------------------------------------------------------------------
    async def _dispatch(self) -> None:
        while True:
            try:  # asyncio.timeout, not wait_for: 3.11's wait_for may swallow a cancel that meets a wakeup
                async with asyncio.timeout(self.poll_s):
                    await self._wakeup.wait()
            except TimeoutError:
                pass
            self._wakeup.clear()
            while self._heap and self._start_head(time.monotonic()):
                pass
            self.metrics.set_batch_queue(num_waiting=len(self._heap), num_running=len(self._running))

    def _start_head(self, now: float) -> bool:
        if now < self._held_until:
            return False
        head = self._heap[0]
        probe = self.view.place(head.info(now), now)
        reason = batch_admission(probe, len(self._running), self._last_rejection, self.gate, self.view.policy_config,
                                 now)
        self.last_wait_reason = reason
        if reason:
            return False
        heapq.heappop(self._heap)
        task = asyncio.create_task(self._run(head), name=f"batch-line-{head.prepared.request_id}")
        self._running[task] = head
        self._started_at[task] = next(self._starts)
        return True

    async def _run(self, queued: QueuedLine) -> None:
        task = asyncio.current_task()
        assert task is not None
        is_answered = False
        try:
            is_answered = await self.serve(queued)
        except asyncio.CancelledError:
            if task not in self._started_at and task in self._running:  # preempted (not withdrawn, not stopped)
                self._requeue(queued, hold_s=0.0)
            raise
        except Exception:
            logger.exception("batch line %s failed unexpectedly; it is queued again", queued.line.custom_id)
        finally:
            self._running.pop(task, None)
            self._started_at.pop(task, None)
            self._wakeup.set()
        if not is_answered:
            self.num_refused += 1
            self._requeue(queued, hold_s=self.poll_s)

    def _requeue(self, queued: QueuedLine, hold_s: float) -> None:
        self._held_until = max(self._held_until, time.monotonic() + hold_s)
        heapq.heappush(self._heap, dataclasses.replace(queued))
