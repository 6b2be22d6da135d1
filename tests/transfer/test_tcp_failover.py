"""TCP paths end to end: a connection reset mid-frame is retried on another connection; the batch completes.
A peer that accepts but never answers fails the batch after io_timeout_s instead of hanging."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from mooncaked.transfer import SegmentRef, TransferEngine, TransferError, TransferOp, TransferRequest

MIB = 1 << 20


class ResettingProxy:
    """Forwards connections to `upstream`; the first one is reset after `reset_after` client bytes."""

    def __init__(self, upstream: tuple[str, int], reset_after: int) -> None:
        self.listener = socket.create_server(("127.0.0.4", 0))
        self.endpoint = f"127.0.0.4:{self.listener.getsockname()[1]}"
        self._upstream = upstream
        self._reset_after = reset_after
        self.num_accepted = 0
        self._threads = [threading.Thread(target=self._accept_loop, daemon=True)]
        self._threads[0].start()

    def close(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        for thread in self._threads:
            thread.join(5)

    def _accept_loop(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.num_accepted += 1
            limit = self._reset_after if self.num_accepted == 1 else None
            server = socket.create_connection(self._upstream)
            for source, sink, budget in ((client, server, limit), (server, client, None)):
                thread = threading.Thread(target=_pump, args=(source, sink, budget), daemon=True)
                self._threads.append(thread)
                thread.start()


def _pump(source: socket.socket, sink: socket.socket, budget: int | None) -> None:
    buffer = bytearray(256 << 10)
    try:
        while True:
            num_bytes = source.recv_into(buffer)
            if num_bytes == 0 or (budget is not None and budget < num_bytes):
                break
            sink.sendall(memoryview(buffer)[:num_bytes])
            budget = None if budget is None else budget - num_bytes
    except OSError:
        pass
    for sock in (source, sink):
        try:
            sock.shutdown(socket.SHUT_RDWR)  # wakes the pump of the other direction
        except OSError:
            pass
        sock.close()


async def test_reset_connection_is_retried_on_another_path() -> None:
    a = TransferEngine(host="127.0.0.1", num_connections_per_peer=2, path_failure_threshold=1)
    b = TransferEngine(host="127.0.0.2")
    await a.start()
    await b.start()
    host, port = b.endpoint.split(":")
    proxy = ResettingProxy((host, int(port)), reset_after=3 * MIB)
    try:
        src = np.random.default_rng(3).integers(0, 256, 32 * MIB, dtype=np.uint8)
        dst = np.zeros_like(src)
        a.register("src", src)
        b.register("dst", dst)
        through_proxy = SegmentRef(proxy.endpoint, "dst")
        batch = a.submit([TransferRequest(TransferOp.WRITE, "src", 0, through_proxy, 0, src.nbytes)])
        await a.wait(batch, timeout_s=20)
        assert np.array_equal(dst, src)
        states = a.path_states(proxy.endpoint)
        assert sorted(states.values()) == [False, True], "the reset path cools down; the other carried the rest"
        assert proxy.num_accepted == 2, "the cooling path did not reconnect"
    finally:
        await a.stop()
        await b.stop()
        proxy.close()  # after the engines: their closed connections end the pump threads


async def test_peer_that_never_answers_fails_the_batch_after_io_timeout() -> None:
    silent = socket.create_server(("127.0.0.5", 0))  # accepts (via the backlog), never reads or replies
    endpoint = f"127.0.0.5:{silent.getsockname()[1]}"
    a = TransferEngine(host="127.0.0.1", num_connections_per_peer=2, max_retries=1, io_timeout_s=0.3)
    await a.start()
    try:
        src = np.zeros(MIB, np.uint8)
        a.register("src", src)
        batch = a.submit([TransferRequest(TransferOp.WRITE, "src", 0, SegmentRef(endpoint, "dst"), 0, MIB)])
        with pytest.raises(TransferError, match="io_timeout_s"):
            await a.wait(batch, timeout_s=10)
    finally:
        await a.stop()
        silent.close()
