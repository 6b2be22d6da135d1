"""RPC calls end to end on 127.0.0.1 and Unix sockets: unary, streams, errors, deadlines, cancellation,
pooling, reconnection and draining stop. Faults (bad frames, auth, limits) are in test_rpc_faults.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Any, AsyncIterator

import pytest

from mooncaked.rpc import (CallContext, DeadlineExceeded, Internal, NotFound, ResourceExhausted, RpcClient, RpcServer,
                           Unavailable)
from mooncaked.rpc.protocol import HEALTH, INFO, HealthReply, HealthRequest, InfoReply, InfoRequest, Message, Method

CLUSTER = "test-cluster"
SECRET = b"test-secret"


@dataclass(frozen=True)
class Echo(Message):
    text: str
    token_ids: list[int]


@dataclass(frozen=True)
class Sleep(Message):
    seconds: float


@dataclass(frozen=True)
class Count(Message):
    n: int


ECHO = Method("test.echo", Echo, Echo)
EAGER_SLEEP = Method("test.eager_sleep", Sleep, Echo)
SLEEP = Method("test.sleep", Sleep, Echo)
FAIL = Method("test.fail", Echo, Echo)
COUNT = Method("test.count", Count, Count, is_streaming=True)
BLOCK = Method("test.block", Echo, Echo)
BAD_REPLY = Method("test.bad_reply", Echo, Echo)


class Service:
    """Handlers that record what happened to them, so tests can see the server side."""

    def __init__(self) -> None:
        self.num_cancelled = 0
        self.cancelled = asyncio.Event()
        self.num_started = 0
        self.release = asyncio.Event()

    async def echo(self, request: Echo, ctx: CallContext) -> Echo:
        return request

    async def sleep(self, request: Sleep, ctx: CallContext) -> Echo:
        self.num_started += 1
        try:
            await asyncio.sleep(request.seconds)
        except asyncio.CancelledError:
            self.num_cancelled += 1
            self.cancelled.set()
            raise
        return Echo(f"slept {request.seconds}", [])

    async def fail(self, request: Echo, ctx: CallContext) -> Echo:
        if request.text == "not found":
            raise NotFound("no such thing")
        raise ValueError("secret detail")

    async def count(self, request: Count, ctx: CallContext) -> AsyncIterator[Count]:
        try:
            for i in range(request.n):
                yield Count(i)
                await asyncio.sleep(0.001 if request.n < 100 else 0.05)
        except asyncio.CancelledError:
            self.num_cancelled += 1
            self.cancelled.set()
            raise

    async def bad_reply(self, request: Echo, ctx: CallContext) -> Echo:
        if request.text == "wrong type":
            return Sleep(1.0)  # type: ignore[return-value]
        if request.text == "too big":
            return Echo("x" * (5 << 20), [])
        return Echo("unpackable", [object()])  # type: ignore[list-item]

    async def block(self, request: Echo, ctx: CallContext) -> Echo:
        self.num_started += 1
        await self.release.wait()
        return request


def make_server(service: Service, **kwargs: object) -> RpcServer:
    server = RpcServer(role="store", instance="store-0", cluster_id=CLUSTER, secret=SECRET, **kwargs)  # type: ignore
    server.add_method(ECHO, service.echo, is_eager=True)
    server.add_method(EAGER_SLEEP, service.sleep, is_eager=True)
    server.add_method(SLEEP, service.sleep)
    server.add_method(FAIL, service.fail)
    server.add_method(COUNT, service.count)
    server.add_method(BLOCK, service.block)
    server.add_method(BAD_REPLY, service.bad_reply, is_eager=True)

    async def health(request: HealthRequest, ctx: CallContext) -> HealthReply:
        return HealthReply(True)

    async def info(request: InfoRequest, ctx: CallContext) -> InfoReply:
        return InfoReply("store", "store-0", "0.1.0", os.getpid(), 1.0, {"peer": ctx.peer_instance})

    server.add_method(HEALTH, health, is_eager=True)
    server.add_method(INFO, info)
    return server


def make_client(address: str, **kwargs: object) -> RpcClient:
    options: dict[str, object] = {"role": "conductor", "instance": "conductor-0", "cluster_id": CLUSTER,
                                  "secret": SECRET, "connect_timeout_s": 2.0, **kwargs}
    return RpcClient(address, **options)  # type: ignore[arg-type]


@pytest.fixture
async def service() -> Service:
    return Service()


@pytest.fixture
async def tcp(service: Service) -> AsyncIterator[tuple[RpcServer, RpcClient]]:
    server = make_server(service)
    port = await server.start_tcp("127.0.0.1", 0)
    client = make_client(f"tcp://127.0.0.1:{port}")
    yield server, client
    await client.close()
    await server.stop(1.0)


@pytest.fixture(params=["tcp", "unix"])
async def any_transport(request: pytest.FixtureRequest, service: Service) -> AsyncIterator[RpcClient]:
    server = make_server(service)
    with tempfile.TemporaryDirectory() as tmp:
        if request.param == "tcp":
            address = f"tcp://127.0.0.1:{await server.start_tcp('127.0.0.1', 0)}"
        else:
            path = os.path.join(tmp, "rpc.sock")
            await server.start_unix(path)
            address = f"unix://{path}"
        client = make_client(address)
        yield client
        await client.close()
        await server.stop(1.0)
        assert not os.path.exists(os.path.join(tmp, "rpc.sock"))


async def test_unary_calls(any_transport: RpcClient) -> None:
    client = any_transport
    reply = await client.call(ECHO, Echo("hello", [1, 2, 3]), timeout_s=5)
    assert reply == Echo("hello", [1, 2, 3])
    assert await client.call(HEALTH, HealthRequest(), timeout_s=5) == HealthReply(True)
    info = await client.call(INFO, InfoRequest(), timeout_s=5)
    assert info.pid == os.getpid() and info.extra == {"peer": "conductor-0"}
    replies = await asyncio.gather(*(client.call(ECHO, Echo(str(i), [i]), timeout_s=5) for i in range(300)))
    assert [r.text for r in replies] == [str(i) for i in range(300)]


async def test_streaming_calls(any_transport: RpcClient) -> None:
    items = [item.n async for item in any_transport.stream(COUNT, Count(20), timeout_s=5)]
    assert items == list(range(20))
    assert [item async for item in any_transport.stream(COUNT, Count(0), timeout_s=5)] == []


async def test_eager_handler_that_suspends(tcp: tuple[RpcServer, RpcClient]) -> None:
    _, client = tcp
    replies = await asyncio.gather(*(client.call(EAGER_SLEEP, Sleep(0.01), timeout_s=5) for _ in range(20)))
    assert all(r.text == "slept 0.01" for r in replies)


async def test_handler_errors_keep_their_code_or_become_internal(
        tcp: tuple[RpcServer, RpcClient], caplog: pytest.LogCaptureFixture) -> None:
    _, client = tcp
    with pytest.raises(NotFound, match="no such thing"):
        await client.call(FAIL, Echo("not found", []), timeout_s=5)
    with caplog.at_level(logging.ERROR):
        with pytest.raises(Internal) as raised:
            await client.call(FAIL, Echo("boom", []), timeout_s=5)
    assert "secret detail" not in raised.value.message and "ValueError" in raised.value.message
    assert "secret detail" in caplog.text
    assert (await client.call(ECHO, Echo("still fine", []), timeout_s=5)).text == "still fine"


async def test_bad_replies_of_an_eager_handler_become_errors(tcp: tuple[RpcServer, RpcClient]) -> None:
    _, client = tcp
    with pytest.raises(Internal, match="TypeError"):
        await client.call(BAD_REPLY, Echo("wrong type", []), timeout_s=5)
    with pytest.raises(Internal, match="TypeError"):
        await client.call(BAD_REPLY, Echo("unpackable", []), timeout_s=5)
    with pytest.raises(ResourceExhausted, match="exceeds the limit"):
        await client.call(BAD_REPLY, Echo("too big", []), timeout_s=5)
    assert (await client.call(ECHO, Echo("still served", []), timeout_s=5)).text == "still served"


@pytest.mark.parametrize("method", [SLEEP, EAGER_SLEEP], ids=["task", "eager"])
async def test_deadline_cancels_the_handler(tcp: tuple[RpcServer, RpcClient], service: Service,
                                            method: Method[Sleep, Echo]) -> None:
    server, client = tcp
    loop = asyncio.get_running_loop()
    began = loop.time()
    with pytest.raises(DeadlineExceeded):
        await client.call(method, Sleep(30), timeout_s=0.2)
    assert 0.15 < loop.time() - began < 1.5
    await asyncio.wait_for(service.cancelled.wait(), 2)
    assert service.num_cancelled == 1 and server.num_inflight_calls == 0


async def test_stream_deadline(tcp: tuple[RpcServer, RpcClient], service: Service) -> None:
    _, client = tcp
    with pytest.raises(DeadlineExceeded):
        async for _ in client.stream(COUNT, Count(1000), timeout_s=0.3):
            pass
    await asyncio.wait_for(service.cancelled.wait(), 2)


async def test_client_task_cancel_reaches_the_handler(tcp: tuple[RpcServer, RpcClient], service: Service) -> None:
    server, client = tcp
    call = asyncio.ensure_future(client.call(SLEEP, Sleep(30), timeout_s=30))
    while service.num_started == 0:
        await asyncio.sleep(0.01)
    assert server.num_inflight_calls == 1
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await asyncio.wait_for(service.cancelled.wait(), 2)
    assert service.num_cancelled == 1


async def test_leaving_a_stream_early_cancels_the_handler(tcp: tuple[RpcServer, RpcClient],
                                                          service: Service) -> None:
    _, client = tcp
    async with contextlib.aclosing(client.stream(COUNT, Count(1000), timeout_s=30)) as items:
        async for item in items:
            if item.n == 2:
                break
    await asyncio.wait_for(service.cancelled.wait(), 2)
    # Without aclosing: breaking out lets the generator be collected, which also sends the cancel.
    service.cancelled.clear()
    async for item in client.stream(COUNT, Count(1000), timeout_s=30):
        if item.n == 1:
            break
    await asyncio.wait_for(service.cancelled.wait(), 2)
    assert service.num_cancelled == 2


async def test_pool_round_robins_over_its_connections(service: Service) -> None:
    server = make_server(service)
    port = await server.start_tcp("127.0.0.1", 0)
    client = make_client(f"tcp://127.0.0.1:{port}", pool_size=3)
    try:
        for _ in range(6):
            await client.call(ECHO, Echo("x", []), timeout_s=5)
        assert len(server.connections) == 3
    finally:
        await client.close()
        await server.stop(1.0)


async def test_reconnect_after_the_server_restarts_on_the_same_port(service: Service) -> None:
    server = make_server(service)
    port = await server.start_tcp("127.0.0.1", 0)
    client = make_client(f"tcp://127.0.0.1:{port}", pool_size=1, connect_timeout_s=3.0)
    try:
        assert (await client.call(ECHO, Echo("before", []), timeout_s=5)).text == "before"
        await server.stop(1.0)
        with pytest.raises((Unavailable, DeadlineExceeded)):
            await client.call(ECHO, Echo("while down", []), timeout_s=0.3)
        # A call made while the server is down waits (backoff) and succeeds once it is back.
        pending = asyncio.ensure_future(client.call(ECHO, Echo("after", []), timeout_s=5))
        await asyncio.sleep(0.3)
        server = make_server(service)
        await server.start_tcp("127.0.0.1", port)
        assert (await pending).text == "after"
    finally:
        await client.close()
        await server.stop(1.0)


async def test_connecting_to_nothing_fails_within_the_connect_timeout() -> None:
    client = make_client("tcp://127.0.0.1:9", connect_timeout_s=0.3)
    loop = asyncio.get_running_loop()
    began = loop.time()
    with pytest.raises(Unavailable, match="cannot connect"):
        await client.call(ECHO, Echo("x", []), timeout_s=5)
    assert loop.time() - began < 2
    await client.close()


async def test_stop_drains_in_flight_calls_then_cancels_the_rest(service: Service) -> None:
    server = make_server(service)
    port = await server.start_tcp("127.0.0.1", 0)
    client = make_client(f"tcp://127.0.0.1:{port}", pool_size=1)
    short = asyncio.ensure_future(client.call(SLEEP, Sleep(0.3), timeout_s=10))
    long = asyncio.ensure_future(client.call(BLOCK, Echo("never released", []), timeout_s=10))
    while service.num_started < 2:
        await asyncio.sleep(0.01)
    assert server.num_inflight_calls == 2
    stopping = asyncio.ensure_future(server.stop(drain_timeout_s=0.8))
    await asyncio.sleep(0.05)
    with pytest.raises(Unavailable, match="stopping"):
        await client.call(ECHO, Echo("too late", []), timeout_s=5)
    assert (await short).text == "slept 0.3"
    with pytest.raises(Unavailable):
        await long
    await asyncio.wait_for(stopping, 5)
    assert server.num_inflight_calls == 0 and not server.connections
    await client.close()


def num_deadlines(wheel: object) -> int:
    buckets: dict[int, Any] = wheel._buckets  # type: ignore[attr-defined]
    return sum(len(keys) for keys in buckets.values())


async def test_finished_calls_leave_no_deadline_behind(tcp: tuple[RpcServer, RpcClient], service: Service) -> None:
    """Calls and streams with hour-long deadlines (a decode stream's) are forgotten when they finish, not then."""
    server, client = tcp
    for i in range(50):
        assert (await client.call(SLEEP, Sleep(0.0), timeout_s=3600.0)).text == "slept 0.0"
        assert [c.n async for c in client.stream(COUNT, Count(2), timeout_s=3600.0)] == [0, 1]
    waiting = asyncio.ensure_future(client.call(BLOCK, Echo("cancelled", []), timeout_s=3600.0))
    while not service.num_started:
        await asyncio.sleep(0.01)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    await asyncio.sleep(0.05)  # the cancel reaches the server
    client_wheels = [conn._deadlines for conn in client._slots if conn is not None]  # type: ignore[attr-defined]
    server_wheels = [conn._deadlines for conn in server.connections]  # type: ignore[attr-defined]
    assert client_wheels and server_wheels
    assert [num_deadlines(w) for w in client_wheels + server_wheels] == [0] * len(client_wheels + server_wheels)
