"""A peer process killed mid-batch: the batch fails within its deadline and other peers keep being served."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time

import numpy as np
import pytest

from mooncaked.transfer import SegmentRef, TransferEngine, TransferError, TransferOp, TransferRequest
from tests.transfer.peer_process import serve_segment

MIB = 1 << 20


async def test_peer_killed_mid_batch_fails_within_deadline() -> None:
    context = multiprocessing.get_context("spawn")
    parent_conn, child_conn = context.Pipe()
    peer = context.Process(target=serve_segment, args=(child_conn, "127.0.0.3", 8 * MIB, 60.0), daemon=True)
    peer.start()
    engine = TransferEngine(host="127.0.0.1", path_cooldown_s=30.0)
    other = TransferEngine(host="127.0.0.2")
    await engine.start()
    await other.start()
    try:
        assert parent_conn.poll(30), "peer process did not report its endpoint"
        dead_ref = SegmentRef(parent_conn.recv(), "sink")
        source = np.arange(8 * MIB, dtype=np.uint8)
        engine.register("src", source)
        batch_id = engine.submit([TransferRequest(TransferOp.WRITE, "src", 0, dead_ref, 0, 8 * MIB)] * 512)
        await _wait_for_progress(engine, batch_id)
        assert peer.pid is not None
        os.kill(peer.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(TransferError, match=r"127\.0\.0\.3") as failure:
            await engine.wait(batch_id, timeout_s=5.0)
        assert "deadline" not in str(failure.value), "the dead peer must be detected, not waited out"
        assert time.monotonic() - started < 5.0
        again = engine.submit([TransferRequest(TransferOp.WRITE, "src", 0, dead_ref, 0, MIB)])
        with pytest.raises(TransferError, match=r"no usable path to 127\.0\.0\.3"):
            await engine.wait(again, timeout_s=5.0)
        sink = np.zeros(8 * MIB, np.uint8)
        alive_ref = other.register("sink", sink)
        ok = engine.submit([TransferRequest(TransferOp.WRITE, "src", 0, alive_ref, 0, 8 * MIB)])
        await engine.wait(ok, timeout_s=5.0)
        assert np.array_equal(sink, source)
    finally:
        peer.kill()
        peer.join(5)
        await engine.stop()
        await other.stop()


async def _wait_for_progress(engine: TransferEngine, batch_id: int) -> None:
    deadline = time.monotonic() + 10
    while engine.status(batch_id).num_bytes_done == 0:
        assert time.monotonic() < deadline, "no progress towards the peer"
        await asyncio.sleep(0.005)
