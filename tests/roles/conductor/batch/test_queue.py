"""The conductor's queue of batch lines (roles/conductor/batch/queue.py) over a stand-in view: order, the in-flight
bound, the SLO headroom gate, lines refused for load queued again, and preemption when interactive work is rejected."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from mooncaked.api.requests import CompletionRequest
from mooncaked.api.sampling_options import SamplingOptions
from mooncaked.roles.conductor.batch.lines import BatchLine
from mooncaked.roles.conductor.batch.queue import BatchQueue, QueuedLine
from mooncaked.roles.conductor.class_metrics import ClassMetrics
from mooncaked.roles.conductor.frontend import ConductorRequest
from mooncaked.runtime.metrics import Metrics
from mooncaked.sched.priority import BatchGate
from mooncaked.sched.types import Placement, PolicyConfig, RequestInfo

SAMPLING = SamplingOptions(None, 1.0, 1.0, 0, None, (), False)


class View:
    """Stands in for the ClusterView: a placement whose predicted TTFT the test sets."""

    def __init__(self) -> None:
        self.policy_config = PolicyConfig(ttft_slo_s=1.0, tbt_slo_s=1.0)
        self.predicted_ttft_s = 0.1

    def place(self, request: RequestInfo, now: float) -> Placement:
        return Placement(request.request_id, "p0", "d0", 0, 0, None, 0, 0.0, 0.0, 0.0, self.predicted_ttft_s, 0.01)


def queued(number: int, priority: int = 0) -> QueuedLine:
    request = CompletionRequest(f"b-{number}", "tiny", (1, 2, 3), SAMPLING, False, False, None, is_batch=True)
    prepared = ConductorRequest(request.request_id, request, (1, 2, 3), 4)
    return QueuedLine((priority, 1, number), "b", BatchLine(number, f"c{number}", request), prepared)


class Lines:
    """The serve function: lines block until released; the test scripts their answers."""

    def __init__(self) -> None:
        self.started: list[int] = []
        self.release: dict[int, asyncio.Future[bool]] = {}
        self.changed = asyncio.Event()

    async def serve(self, line: QueuedLine) -> bool:
        number = line.line.number
        self.started.append(number)
        self.release[number] = asyncio.get_running_loop().create_future()
        self.changed.set()
        return await self.release[number]

    async def wait_started(self, count: int) -> None:
        async with asyncio.timeout(5):
            while len(self.started) < count:
                self.changed.clear()
                await self.changed.wait()


def make(lines: Lines, view: View, max_in_flight: int = 2) -> BatchQueue:
    gate = BatchGate(max_in_flight=max_in_flight, margin=0.5, backoff_s=0.2)
    return BatchQueue(view, gate, lines.serve, 0.01, ClassMetrics(Metrics()))  # type: ignore[arg-type]


async def test_order_bound_gate_retry_and_preemption() -> None:
    lines, view = Lines(), View()
    queue = make(lines, view)
    await queue.start()
    try:
        queue.submit([queued(1, priority=5), queued(2), queued(3, priority=-1), queued(4)])
        await lines.wait_started(2)
        await asyncio.sleep(0.05)
        assert lines.started == [3, 2] and queue.num_running == 2  # priority order, at most 2 in flight
        view.predicted_ttft_s = 0.6  # over half the SLO: nothing more starts
        lines.release[3].set_result(True)
        await asyncio.sleep(0.05)
        assert lines.started == [3, 2] and "TTFT" in queue.last_wait_reason
        view.predicted_ttft_s = 0.1
        await lines.wait_started(3)
        assert lines.started[-1] == 4
        lines.release[2].set_result(False)  # refused for load: queued again, not answered
        await lines.wait_started(4)
        assert lines.started[-1] == 2 and queue.num_refused == 1
        queue.interactive_rejected(asyncio.get_running_loop().time())  # the youngest running line (2) yields
        await lines.wait_started(5)
        assert lines.started[-1] == 2 and queue.num_preempted == 1
        await queue.withdraw("b")
        assert queue.num_waiting == 0 and queue.num_running == 0
    finally:
        await queue.stop()


class FailingOnceView(View):
    """Its first placement raises: a bug or a bad sample the dispatch loop did not expect."""

    def __init__(self) -> None:
        super().__init__()
        self.num_calls = 0

    def place(self, request: RequestInfo, now: float) -> Placement:
        self.num_calls += 1
        if self.num_calls == 1:
            raise ZeroDivisionError("injected")
        return super().place(request, now)


async def test_dispatch_survives_an_unexpected_exception(caplog: pytest.LogCaptureFixture) -> None:
    lines, view = Lines(), FailingOnceView()
    queue = make(lines, view)
    await queue.start()
    try:
        queue.submit([queued(1)])
        await lines.wait_started(1)  # after the restart
        assert "background loop batch-dispatch failed: ZeroDivisionError: injected; restarting it" in caplog.text
    finally:
        lines.release[1].set_result(True)
        await queue.stop()
