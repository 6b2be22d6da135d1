"""Slow and greedy HTTP clients against the real app behind a GuardedSite on loopback: late headers and bodies are
cut off at client_timeout_s, connections per address are capped, each with a log line; nobody else notices."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from mooncaked.api.app import create_app
from mooncaked.api.client_guard import ClientGuard, GuardedSite
from tests.api.scripted_backend import MODEL_ID, ScriptedBackend

TIMEOUT_S = 0.5
LIMIT = 8
GOOD = json.dumps({"model": MODEL_ID, "prompt": "hi", "max_tokens": 2}).encode()


class Served:
    def __init__(self, runner: web.AppRunner, guard: ClientGuard, port: int) -> None:
        self.runner, self.guard, self.port = runner, guard, port

    def connect(self, source: str = "127.0.0.1") -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=10, source_address=(source, 0))
        return sock

    async def good_request(self, source: str = "127.0.0.2") -> int:
        connector = aiohttp.TCPConnector(local_addr=(source, 0))
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=10)) as session:
            async with session.post(f"http://127.0.0.1:{self.port}/v1/completions", data=GOOD) as response:
                await response.read()
                return response.status


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    guard = ClientGuard(client_timeout_s=TIMEOUT_S, max_connections_per_client=LIMIT)
    app = create_app(ScriptedBackend(token_delay_s=0.2), api_keys=frozenset(), max_body_bytes=1 << 20,
                     request_timeout_s=10.0, client_guard=guard)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = GuardedSite(runner, "127.0.0.1", 0, guard)
    await site.start()
    port = next(int(address[1]) for address in runner.addresses if isinstance(address, tuple))
    yield Served(runner, guard, port)
    await runner.cleanup()


def read_until_closed(sock: socket.socket) -> bytes:
    received = bytearray()
    while chunk := sock.recv(65536):
        received += chunk
    return bytes(received)


def read_response(sock: socket.socket) -> bytes:
    """One whole response with a Content-Length (keep-alive: the connection stays open)."""
    received = bytearray()
    while b"\r\n\r\n" not in received:
        received += sock.recv(65536)
    head, _, body = bytes(received).partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(65536)
    assert len(body) == length
    return head + b"\r\n\r\n" + body


def headers(content_length: int) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {content_length}\r\n\r\n").encode()


async def test_late_headers_are_cut_off_even_when_they_trickle(served: Served,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="mooncaked.api.client_guard")
    with served.connect() as sock:
        started = time.monotonic()
        for byte in b"POST /v1/completions HTTP/1.1\r\nHost: slow\r\n":
            try:
                sock.send(bytes([byte]))
            except OSError:
                break
            await asyncio.sleep(0.05)  # a byte every 50 ms: never idle, never done
            if time.monotonic() - started > 5 * TIMEOUT_S:
                break
        assert await asyncio.to_thread(read_until_closed, sock) == b""
        assert time.monotonic() - started < 4 * TIMEOUT_S
    assert served.guard.num_cut_off == 1
    assert any("request headers did not arrive within conductor.client_timeout_s" in r.getMessage()
               for r in caplog.records)


async def test_a_late_body_gets_408_and_the_connection_closes(served: Served) -> None:
    with served.connect() as sock:
        sock.sendall(headers(len(GOOD)) + GOOD[:5])
        answer = await asyncio.to_thread(read_until_closed, sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408")
    assert json.loads(body)["error"]["code"] == "request_timeout"


async def test_four_hundred_stalled_bodies_hold_nothing_and_others_are_served(
    served: Served, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="mooncaked.api.client_guard")
    sockets: list[socket.socket] = []

    def stall() -> None:  # in a thread: the server runs on this test's loop
        for _ in range(400):
            sock = served.connect()
            sockets.append(sock)
            try:
                sock.sendall(headers(1000) + b"{")
            except OSError:  # refused and closed already
                pass

    try:
        await asyncio.to_thread(stall)
        assert await served.good_request() == 200, "another address is served meanwhile"
        answers = await asyncio.gather(*(asyncio.to_thread(read_until_closed, sock) for sock in sockets))
    finally:
        for sock in sockets:
            sock.close()
    statuses = [answer.split(b" ", 2)[1] for answer in answers]
    assert set(statuses) == {b"408", b"429"}, "each one cut off with a 408 or refused with a 429"
    assert statuses.count(b"408") >= LIMIT  # more when slots freed by cut-offs were taken again
    deadline = time.monotonic() + 5
    while served.guard.num_open:  # the server's side closes once the client's has
        assert time.monotonic() < deadline, f"connections left open: {served.guard.num_open}"
        await asyncio.sleep(0.02)
    refusals = [r.getMessage() for r in caplog.records if "refused a connection from 127.0.0.1" in r.getMessage()]
    assert 1 <= len(refusals) <= 2, "logged, not flooded"


async def test_idle_keep_alive_and_long_streams_are_not_cut_off(served: Served) -> None:
    with served.connect() as sock:
        sock.settimeout(10)
        for _ in range(2):
            sock.sendall(headers(len(GOOD)) + GOOD)
            answer = await asyncio.to_thread(read_response, sock)  # the server runs on this loop
            assert answer.startswith(b"HTTP/1.1 200"), answer
            await asyncio.sleep(2 * TIMEOUT_S)  # idle between requests: no clock runs
    connector = aiohttp.TCPConnector(local_addr=("127.0.0.1", 0))
    async with aiohttp.ClientSession(connector=connector) as session:
        body = {"model": MODEL_ID, "prompt": "hi", "max_tokens": 5, "stream": True}  # 5 x 0.2 s > TIMEOUT_S
        async with session.post(f"http://127.0.0.1:{served.port}/v1/completions", json=body) as response:
            assert response.status == 200 and (await response.text()).rstrip().endswith("data: [DONE]")
    assert served.guard.num_cut_off == 0


async def test_a_freed_slot_is_reused(served: Served) -> None:
    held = [served.connect() for _ in range(LIMIT)]
    await asyncio.sleep(0.1)
    with served.connect() as extra:
        assert (await asyncio.to_thread(read_until_closed, extra)).startswith(b"HTTP/1.1 429")
    held.pop().close()
    deadline = time.monotonic() + 5
    while served.guard.num_open["127.0.0.1"] >= LIMIT:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    assert await served.good_request(source="127.0.0.1") == 200
    for sock in held:
        sock.close()


def test_the_log_bookkeeping_forgets_quiet_addresses(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    guard = ClientGuard(client_timeout_s=TIMEOUT_S, max_connections_per_client=LIMIT, clock=lambda: now[0])
    for i in range(1000):  # a thousand clients come and go, twice each within one interval
        for _ in range(2):
            guard._log(f"10.0.{i // 250}.{i % 250}", "body", "cut off %s", f"client {i}")
    assert len(guard._last_logged) == 1000 and sum(guard._num_unlogged.values()) == 1000
    now[0] = 10.5
    guard._log("10.9.9.9", "body", "cut off %s", "a later client")
    assert list(guard._last_logged) == [("10.9.9.9", "body")] and not guard._num_unlogged
    assert "1 more cut-offs or refusals (body) of 10.0.3.249 were not logged" in caplog.text
