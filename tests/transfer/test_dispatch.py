"""PeerQueue: runs of whole slices, retry on another path, cooldown, topology tiers, giving up."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from mooncaked.transfer.batch import BatchRecord
from mooncaked.transfer.dispatch import PeerQueue, Piece, run_bytes_for
from mooncaked.transfer.paths import PathHealth
from mooncaked.transfer.types import BatchState, TransferOp


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def make_piece(batch: BatchRecord, length: int, run_bytes: int, tiers: dict[str, int] | None = None) -> Piece:
    return Piece(batch, 0, TransferOp.WRITE, memoryview(bytearray(length)), "seg", 0, length, run_bytes, tiers)


def make_queue(clock: Clock, max_retries: int = 3, threshold: int = 2) -> PeerQueue:
    return PeerQueue("peer:1", ["p0", "p1"], PathHealth(threshold, cooldown_s=5.0), max_retries, clock)


def test_run_bytes_spreads_a_request_over_paths_in_whole_slices() -> None:
    assert run_bytes_for(64 << 20, 64 << 10, 4, 4 << 20) == 4 << 20
    assert run_bytes_for(1 << 20, 64 << 10, 4, 4 << 20) == 256 << 10
    assert run_bytes_for(1000, 64 << 10, 4, 4 << 20) == 64 << 10
    assert run_bytes_for(100 << 10, 64 << 10, 4, 4 << 20) == 64 << 10


def test_take_cuts_runs_and_success_completes_the_batch(loop: asyncio.AbstractEventLoop) -> None:
    clock = Clock()
    queue = make_queue(clock)
    batch = BatchRecord(1, 300, loop)
    queue.put([make_piece(batch, 300, 128)])
    runs = [queue.take("p0", 0), queue.take("p1", 0), queue.take("p0", 0)]
    assert [run.length if run else None for run in runs] == [128, 128, 44]
    assert [run.remote_offset if run else None for run in runs] == [0, 128, 256]
    assert queue.take("p1", 0) is None
    for run in runs:
        assert run is not None
        queue.succeed("p0", run)
    assert batch.state is BatchState.DONE


def test_failed_run_is_retried_on_another_path(loop: asyncio.AbstractEventLoop) -> None:
    clock = Clock()
    queue = make_queue(clock)
    batch = BatchRecord(1, 10, loop)
    queue.put([make_piece(batch, 10, 64)])
    run = queue.take("p0", 0)
    assert run is not None
    queue.retry("p0", run, "connection reset")
    assert queue.take("p0", 0) is None, "the path it failed on is skipped while another is usable"
    retried = queue.take("p1", 0)
    assert retried is run and retried.failed_paths == frozenset({"p0"})
    queue.succeed("p1", retried)
    assert batch.state is BatchState.DONE


def test_a_path_that_keeps_failing_cools_down_then_recovers(loop: asyncio.AbstractEventLoop) -> None:
    clock = Clock()
    queue = make_queue(clock, max_retries=10)
    for _ in range(2):
        batch = BatchRecord(1, 10, loop)
        queue.put([make_piece(batch, 10, 64)])
        run = queue.take("p0", 0)
        assert run is not None
        queue.retry("p0", run, "refused")
        assert queue.take("p1", 0) is run
        queue.succeed("p1", run)
    assert not queue.health.is_usable("p0", clock.now)
    fresh = BatchRecord(2, 10, loop)
    queue.put([make_piece(fresh, 10, 64)])
    assert queue.take("p0", 0) is None, "a cooling path takes nothing, not even fresh work"
    clock.now += 5.0
    assert queue.take("p0", 0) is not None


def test_all_paths_cooling_fails_pending_work_at_once(loop: asyncio.AbstractEventLoop) -> None:
    clock = Clock()
    queue = make_queue(clock, max_retries=10, threshold=1)
    batch, waiting = BatchRecord(1, 10, loop), BatchRecord(2, 10, loop)
    queue.put([make_piece(batch, 10, 64), make_piece(waiting, 10, 64)])
    first = queue.take("p0", 0)
    assert first is not None
    queue.retry("p0", first, "refused")
    second = queue.take("p1", 0)
    assert second is first
    queue.retry("p1", second, "refused")
    assert batch.state is BatchState.FAILED and waiting.state is BatchState.FAILED
    assert waiting.error is not None and "no usable path to peer:1" in waiting.error
    late = BatchRecord(3, 10, loop)
    queue.put([make_piece(late, 10, 64)])
    assert late.state is BatchState.FAILED, "new work to a peer with no usable path fails at submit"


def test_retries_are_bounded(loop: asyncio.AbstractEventLoop) -> None:
    clock = Clock()
    queue = make_queue(clock, max_retries=1, threshold=10)
    batch = BatchRecord(1, 10, loop)
    queue.put([make_piece(batch, 10, 64)])
    for path in ("p0", "p1"):
        run = queue.take(path, 0)
        assert run is not None
        queue.retry(path, run, "timeout")
    assert batch.error is not None and "gave up after 2 attempts" in batch.error


def test_preferred_tier_first_secondary_on_failure(loop: asyncio.AbstractEventLoop) -> None:
    clock = Clock()
    queue = make_queue(clock, threshold=1)
    batch = BatchRecord(1, 20, loop)
    tiers = {"p0": 0, "p1": 1}
    queue.put([make_piece(batch, 10, 64, tiers), make_piece(batch, 10, 64, tiers)])
    assert queue.take("p1", 0) is None, "secondary path idle while the preferred one is usable"
    run = queue.take("p0", 0)
    assert run is not None
    queue.retry("p0", run, "port down")
    assert queue.take("p1", 0) is run
    assert queue.take("p1", 0) is not None, "fresh work also moves to the secondary path while p0 cools"


def test_close_fails_pending_batches(loop: asyncio.AbstractEventLoop) -> None:
    queue = make_queue(Clock())
    batch = BatchRecord(1, 10, loop)
    queue.put([make_piece(batch, 10, 64)])
    queue.close("engine stopped")
    assert batch.error == "batch 1: engine stopped"
    assert queue.take("p0", 0) is None


def test_a_failure_cools_down_every_path_of_its_domain_and_its_runs_go_elsewhere(
        loop: asyncio.AbstractEventLoop) -> None:
    clock = Clock()
    queue = PeerQueue("peer:1", [], PathHealth(1, cooldown_s=5.0), 3, clock)
    batch = BatchRecord(1, 300, loop)
    queue.put([make_piece(batch, 300, 100)])  # no paths yet (NICs being learnt): the piece waits
    assert batch.state is BatchState.PENDING and queue.take("a#0", 0) is None
    queue.set_paths(["a#0", "a#1", "b#0"], {"a#0": "a", "a#1": "a", "b#0": "b"})
    run = queue.take("a#0", 0)
    assert run is not None
    queue.retry("a#0", run, "link down")
    assert queue.path_states() == {"a#0": False, "a#1": False, "b#0": True}
    assert (queue.num_failures("a#1"), queue.num_failures("b#0")) == (1, 0), "a#1's idle connection is suspect"
    assert queue.take("a#1", 0) is None, "the whole NIC pair cools down"
    retried = queue.take("b#0", 0)
    assert retried is not None and retried.remote_offset == 0 and "a#1" in retried.failed_paths
    clock.now += 5.0
    assert queue.take("a#1", 0) is not None, "after the cooldown the pair carries runs again"


def test_runs_go_to_the_paths_serving_their_memory_first(loop: asyncio.AbstractEventLoop) -> None:
    clock = Clock()
    queue = PeerQueue("peer:1", [], PathHealth(1, cooldown_s=5.0), 3, clock)
    queue.set_paths(["near", "far"], tiers_for=lambda location: {"near": 0 if location == "cpu:0" else 1,
                                                                   "far": 0 if location == "cpu:1" else 1})
    batch = BatchRecord(1, 200, loop)
    piece = make_piece(batch, 200, 100)
    piece.location = "cpu:1"
    queue.put([piece])
    assert queue.take("near", 0) is None
    run = queue.take("far", 0)
    assert run is not None
    queue.retry("far", run, "reset")
    assert queue.take("near", 0) is not None, "the other tier once the serving path cools down"
