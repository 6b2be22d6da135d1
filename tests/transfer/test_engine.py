"""TransferEngine over tcp and local: random sizes and offsets, concurrency, bad requests."""

from __future__ import annotations

import asyncio
import mmap
from collections.abc import AsyncIterator

import numpy as np
import pytest

from mooncaked.transfer import (
    BatchState,
    SegmentRef,
    TransferEngine,
    TransferError,
    TransferOp,
    TransferRequest,
)

MIB = 1 << 20
SEGMENT_BYTES = 64 * MIB


@pytest.fixture
async def engines() -> AsyncIterator[tuple[TransferEngine, TransferEngine]]:
    a = TransferEngine(host="127.0.0.1")
    b = TransferEngine(host="127.0.0.2")
    await a.start()
    await b.start()
    yield a, b
    await a.stop()
    await b.stop()


def random_bytes(rng: np.random.Generator, num_bytes: int) -> np.ndarray:
    return np.frombuffer(rng.bytes(num_bytes), dtype=np.uint8).copy()


def random_layout(rng: np.random.Generator, capacity: int) -> list[tuple[int, int]]:
    """Non-overlapping (offset, length) ranges in [0, capacity), lengths log-uniform in 1 B .. 16 MiB."""
    ranges: list[tuple[int, int]] = []
    offset = 0
    while True:
        length = int(2 ** rng.uniform(0, 24))
        gap = int(rng.integers(0, 4096))
        if offset + gap + length > capacity:
            return ranges
        ranges.append((offset + gap, length))
        offset += gap + length


async def test_random_reads_and_writes_byte_for_byte(engines: tuple[TransferEngine, TransferEngine]) -> None:
    a, b = engines
    rng = np.random.default_rng(0)
    a_src, a_dst = random_bytes(rng, SEGMENT_BYTES), np.zeros(SEGMENT_BYTES, np.uint8)
    b_src, b_dst = random_bytes(rng, SEGMENT_BYTES), np.zeros(SEGMENT_BYTES, np.uint8)
    a.register("a_src", a_src)
    a.register("a_dst", a_dst)
    b_src_ref, b_dst_ref = b.register("b_src", b_src), b.register("b_dst", b_dst)
    num_bytes_moved = 0
    for round_index in range(10):
        a_dst.fill(0)
        b_dst.fill(0)
        checks, batch_ids = [], []
        layout = random_layout(rng, SEGMENT_BYTES)
        if round_index == 0:
            layout = [(0, SEGMENT_BYTES)]  # one full 64 MiB request
        for op, src, dst in ((TransferOp.WRITE, a_src, b_dst), (TransferOp.READ, b_src, a_dst)):
            requests = []
            for dst_offset, length in layout:
                src_offset = int(rng.integers(0, SEGMENT_BYTES - length + 1))
                if op is TransferOp.WRITE:
                    requests.append(TransferRequest(op, "a_src", src_offset, b_dst_ref, dst_offset, length))
                else:
                    requests.append(TransferRequest(op, "a_dst", dst_offset, b_src_ref, src_offset, length))
                checks.append((src, src_offset, dst, dst_offset, length))
            for start in range(0, len(requests), 3):  # many concurrent batches of 1..3 requests
                batch_ids.append(a.submit(requests[start : start + 3]))
        await asyncio.gather(*(a.wait(batch_id, timeout_s=30) for batch_id in batch_ids))
        for src, src_offset, dst, dst_offset, length in checks:
            assert np.array_equal(src[src_offset : src_offset + length], dst[dst_offset : dst_offset + length])
            num_bytes_moved += length
    assert num_bytes_moved > 900 * MIB, num_bytes_moved


async def test_status_reports_progress_and_done(engines: tuple[TransferEngine, TransferEngine]) -> None:
    a, b = engines
    a.register("src", bytearray(b"x" * 1000))
    sink = bytearray(1000)
    ref = b.register("sink", sink)
    batch_id = a.submit([TransferRequest(TransferOp.WRITE, "src", 0, ref, 0, 1000)])
    assert a.status(batch_id).num_bytes_total == 1000
    await a.wait(batch_id, timeout_s=5)
    assert sink == bytearray(b"x" * 1000)
    with pytest.raises(KeyError, match="unknown batch id"):
        a.status(batch_id)


async def test_empty_batch_is_done_at_once(engines: tuple[TransferEngine, TransferEngine]) -> None:
    a, _ = engines
    batch_id = a.submit([])
    assert a.status(batch_id).state is BatchState.DONE
    await a.wait(batch_id, timeout_s=1)


async def test_local_transport_same_engine_and_same_host_alias() -> None:
    engine = TransferEngine(host="127.0.0.1", transports=("local",))
    await engine.start()
    try:
        with mmap.mmap(-1, 4 * MIB) as pool:
            pool_ref = engine.register("pool", pool)
            staging = np.arange(4 * MIB, dtype=np.uint8)
            engine.register("staging", staging)
            alias = SegmentRef("127.0.0.1:1", "pool")  # another engine on this host mapping the same pool
            batch_id = engine.submit(
                [
                    TransferRequest(TransferOp.WRITE, "staging", 0, pool_ref, 0, 3 * MIB),
                    TransferRequest(TransferOp.WRITE, "staging", 100, alias, 3 * MIB, MIB),
                ]
            )
            await engine.wait(batch_id, timeout_s=5)
            assert pool[: 3 * MIB] == staging[: 3 * MIB].tobytes()
            assert pool[3 * MIB :] == staging[100 : 100 + MIB].tobytes()
            back = bytearray(10)
            engine.register("back", back)
            batch_id = engine.submit([TransferRequest(TransferOp.READ, "back", 0, alias, 5, 10)])
            await engine.wait(batch_id, timeout_s=5)
            assert back == pool[5:15]
            engine.unregister("pool")
    finally:
        await engine.stop()


async def test_bad_requests_name_index_and_problem(engines: tuple[TransferEngine, TransferEngine]) -> None:
    a, b = engines
    a.register("src", bytearray(100))
    ref = b.register("sink", bytearray(100))
    ok = TransferRequest(TransferOp.WRITE, "src", 0, ref, 0, 10)
    with pytest.raises(ValueError, match=r"request 1: range \[95, 105\) is outside segment 'src' of 100 bytes"):
        a.submit([ok, TransferRequest(TransferOp.WRITE, "src", 95, ref, 0, 10)])
    with pytest.raises(ValueError, match="request 0: segment 'nope' is not registered"):
        a.submit([TransferRequest(TransferOp.READ, "nope", 0, ref, 0, 10)])
    with pytest.raises(ValueError, match="request 0: length must be >= 1"):
        a.submit([TransferRequest(TransferOp.READ, "src", 0, ref, 0, 0)])
    with pytest.raises(ValueError, match="request 0: endpoint must look like 'host:port'"):
        a.submit([TransferRequest(TransferOp.READ, "src", 0, SegmentRef("nohost", "x"), 0, 1)])
    with pytest.raises(ValueError, match="already registered"):
        a.register("src", bytearray(1))


async def test_remote_out_of_bounds_and_unknown_segment_fail_the_batch(
    engines: tuple[TransferEngine, TransferEngine],
) -> None:
    a, b = engines
    a.register("src", bytearray(1 << 20))
    ref = b.register("sink", bytearray(100))
    for op in (TransferOp.WRITE, TransferOp.READ):
        batch_id = a.submit([TransferRequest(op, "src", 0, ref, 50, 100)])
        with pytest.raises(TransferError, match=r"request 0: .* refused: range \[50, 150\) is outside segment 'sink'"):
            await a.wait(batch_id, timeout_s=5)
        missing = SegmentRef(b.endpoint, "missing")
        batch_id = a.submit([TransferRequest(op, "src", 0, missing, 0, 1 << 20)])
        with pytest.raises(TransferError, match="segment 'missing' is not registered"):
            await a.wait(batch_id, timeout_s=5)
    good = a.submit([TransferRequest(TransferOp.WRITE, "src", 0, ref, 0, 100)])  # connections still in step
    await a.wait(good, timeout_s=5)


async def test_deadline_fails_the_batch(engines: tuple[TransferEngine, TransferEngine]) -> None:
    a, b = engines
    a.register("src", np.zeros(64 * MIB, np.uint8))
    ref = b.register("sink", np.zeros(64 * MIB, np.uint8))
    requests = [TransferRequest(TransferOp.WRITE, "src", 0, ref, 0, 64 * MIB)] * 64
    batch_id = a.submit(requests)
    with pytest.raises(TransferError, match="deadline of 0.01s exceeded"):
        await a.wait(batch_id, timeout_s=0.01)


async def test_memory_can_be_unmapped_as_soon_as_wait_returns(engines: tuple[TransferEngine, TransferEngine]) -> None:
    a, b = engines
    sink = b.register("sink", bytearray(MIB))
    for index in range(20):
        with mmap.mmap(-1, MIB) as region:
            a.register("region", region)
            remote = sink if index % 2 else SegmentRef(a.endpoint, "region")  # tcp, then local
            op = TransferOp.READ if index % 4 < 2 else TransferOp.WRITE
            await a.wait(a.submit([TransferRequest(op, "region", 0, remote, 0, MIB)] * 3), timeout_s=5)
            a.unregister("region")


async def test_remote_request_without_a_network_transport_says_so() -> None:
    engine = TransferEngine(host="127.0.0.1", transports=("local",))
    await engine.start()
    try:
        engine.register("src", bytearray(10))
        remote = SegmentRef("127.0.0.9:7000", "dst")
        with pytest.raises(ValueError, match="request 0: 127.0.0.9:7000 is another host and no network transport"):
            engine.submit([TransferRequest(TransferOp.WRITE, "src", 0, remote, 0, 10)])
    finally:
        await engine.stop()


def test_bad_options_name_the_option() -> None:
    with pytest.raises(ValueError, match=r"transports must be a non-empty subset of .* got \['udp'\]"):
        TransferEngine(host="127.0.0.1", transports=("udp",))
    with pytest.raises(ValueError, match="slice_bytes must be >= 1, got 0"):
        TransferEngine(host="127.0.0.1", slice_bytes=0)
    with pytest.raises(ValueError, match="max_retries must be >= 0"):
        TransferEngine(host="127.0.0.1", max_retries=-1)
    with pytest.raises(ValueError, match=r"tcp_send_buffer_bytes must be >= 0 \(0: kernel default\), got -1"):
        TransferEngine(host="127.0.0.1", tcp_send_buffer_bytes=-1)


async def test_stop_drains_pending_batches_then_refuses_new_ones() -> None:
    a, b = TransferEngine(host="127.0.0.1"), TransferEngine(host="127.0.0.2")
    await a.start()
    await b.start()
    try:
        a.register("src", np.ones(16 * MIB, np.uint8))
        sink = np.zeros(16 * MIB, np.uint8)
        ref = b.register("sink", sink)
        batch_id = a.submit([TransferRequest(TransferOp.WRITE, "src", 0, ref, 0, 16 * MIB)])
        await a.stop(drain_timeout_s=10)
        assert a.status(batch_id).state is BatchState.DONE and sink.all()
        with pytest.raises(RuntimeError, match="the engine is not running"):
            a.submit([TransferRequest(TransferOp.WRITE, "src", 0, ref, 0, 1)])
    finally:
        await b.stop()


async def test_mixed_reads_and_writes_on_one_connection_never_stall() -> None:
    a = TransferEngine(
        host="127.0.0.1", num_connections_per_peer=1, path_failure_threshold=1, io_timeout_s=5, tcp_frame_bytes=64 * MIB
    )  # 8 MiB frames: more than the socket buffers hold
    b = TransferEngine(host="127.0.0.2")
    await a.start()
    await b.start()
    try:
        rng = np.random.default_rng(5)
        local, remote = random_bytes(rng, 64 * MIB), random_bytes(rng, 64 * MIB)
        expected_local, expected_remote = local.copy(), remote.copy()
        a.register("local", local)
        ref = b.register("remote", remote)
        step = 8 * MIB
        requests = [  # READ into even local slots, WRITE from odd ones: payloads flow both ways at once
            TransferRequest(TransferOp.READ if i % 2 == 0 else TransferOp.WRITE, "local", i * step, ref, i * step, step)
            for i in range(8)
        ]
        await a.wait(a.submit(requests), timeout_s=30)
        for i in range(8):
            window = slice(i * step, (i + 1) * step)
            source = expected_remote if i % 2 == 0 else expected_local
            assert np.array_equal(local[window] if i % 2 == 0 else remote[window], source[window])
        assert all(a.path_states(b.endpoint).values()), "no connection timed out"
    finally:
        await a.stop()
        await b.stop()
