"""A request's copies and staging: no copy starts after release, running ones are waited for, and staging is
held only while moves use it (a buffer a move was abandoned in is dropped, not reused)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Iterator

import pytest
import torch

from mooncaked.engine.kv_pages import KVPages
from mooncaked.engine.staging_pool import StagingPool
from mooncaked.model.presets import random_preset
from mooncaked.roles.worker.kv.request_memory import CopyTracker, StagingHold


@pytest.fixture
def copy_thread() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-copy")
    yield executor
    executor.shutdown(wait=True)


def staging_pool(registered: list[str]) -> StagingPool:
    pages = KVPages.for_model(random_preset("tiny"), num_pages=4, block_size=4, dtype=torch.float32, device="cpu")
    return StagingPool(pages, "w", lambda name, data: registered.append(name),
                       lambda name: registered.remove(name))


async def test_a_released_request_starts_no_copy_and_waits_for_the_running_one(
        copy_thread: concurrent.futures.ThreadPoolExecutor) -> None:
    tracker = CopyTracker(copy_thread, "r")
    gate, started = threading.Event(), threading.Event()

    def blocked_copy() -> None:
        started.set()
        gate.wait(10)

    running = tracker.submit(blocked_copy)
    queued = tracker.submit(lambda: None)
    started.wait(10)
    tracker.close()
    with pytest.raises(asyncio.CancelledError):
        tracker.submit(lambda: None)
    assert not await tracker.settle(0.05), "a copy still runs past the deadline"
    assert queued.cancelled()
    gate.set()
    assert await tracker.settle(10) and running.done()


async def test_staging_is_held_while_moves_use_it_and_dropped_after_an_abandoned_one() -> None:
    registered: list[str] = []
    hold = StagingHold(staging_pool(registered), 2)
    assert hold.buffer is None and registered == []
    async with hold as (buffer, first):
        async with hold as (_, second):
            assert first is second and first.shape[0] == 2 and hold.buffer is buffer
        assert hold.buffer is not None
    assert hold.buffer is None and len(registered) == 1, "given back, kept for reuse"
    with pytest.raises(TimeoutError):
        async with hold:
            raise TimeoutError("a move failed mid-flight")
    assert hold.buffer is None and registered == [], "dropped: a late byte may still land in it"
    hold.close()
    with pytest.raises(asyncio.CancelledError):
        async with hold:
            pass
    assert hold.buffer is None and registered == []
