"""Supervised background loops: an exception is logged, then the loop restarts or its instance is marked failed."""

from __future__ import annotations

import asyncio
import logging

import pytest

from mooncaked.runtime.supervised import start_supervised, stop_task


async def test_a_loop_that_raises_is_logged_and_restarted(caplog: pytest.LogCaptureFixture) -> None:
    runs: list[int] = []
    second_run = asyncio.Event()

    async def run() -> None:
        runs.append(len(runs))
        if len(runs) == 1:
            raise ValueError("injected")
        second_run.set()
        await asyncio.Event().wait()

    with caplog.at_level(logging.ERROR, logger="mooncaked.runtime.supervised"):
        task = start_supervised("test-loop", run)
        await asyncio.wait_for(second_run.wait(), 5)
        await stop_task(task)
    assert runs == [0, 1] and task.cancelled()
    (record,) = caplog.records
    assert "background loop test-loop failed: ValueError: injected; restarting it" in record.getMessage()
    assert record.exc_info is not None


async def test_a_loop_that_returns_is_a_failure_too(caplog: pytest.LogCaptureFixture) -> None:
    failures: list[str] = []

    async def run() -> None:
        return

    task = start_supervised("short-lived", run, on_failure=failures.append)
    await asyncio.wait_for(task, 5)
    assert failures == ["background loop short-lived failed: LoopEnded: short-lived returned"]
    assert "the instance is marked failed" in caplog.text


async def test_with_on_failure_the_owner_is_told_and_nothing_restarts() -> None:
    failures: list[str] = []
    runs: list[int] = []

    async def run() -> None:
        runs.append(1)
        raise RuntimeError("state is broken")

    await asyncio.wait_for(start_supervised("decode-loop", run, on_failure=failures.append), 5)
    assert runs == [1] and failures == ["background loop decode-loop failed: RuntimeError: state is broken"]


async def test_stop_task_absorbs_only_the_tasks_own_cancellation() -> None:
    started = asyncio.Event()

    async def forever() -> None:
        started.set()
        await asyncio.Event().wait()

    inner = start_supervised("inner", forever)
    await started.wait()
    stopper = asyncio.ensure_future(stop_task(inner))
    await asyncio.sleep(0)
    stopper.cancel()  # the caller of stop_task is cancelled while it waits: that must propagate
    with pytest.raises(asyncio.CancelledError):
        await stopper
    await stop_task(None)
