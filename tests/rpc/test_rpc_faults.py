"""Faults against a live RPC server: bad frames, authentication, limits. Each must close only the offending
connection, with a logged reason, while well-behaved clients keep being served."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import random
import struct
from typing import Any, AsyncIterator

import msgpack
import pytest

from mooncaked.bench.cluster import free_port
from mooncaked.rpc import (DeadlineExceeded, InvalidArgument, NotFound, ResourceExhausted, RpcClient, RpcServer,
                           Unauthenticated)
from mooncaked.rpc.frames import handshake_proof
from mooncaked.rpc.protocol import (PROTOCOL_VERSION, Auth, CallFrame, CancelFrame, Challenge, ErrorFrame, Hello,
                                    ResultFrame, Welcome, decode_frame, encode_array, encode_frame)
from tests.rpc.test_rpc import BLOCK, CLUSTER, EAGER_SLEEP, ECHO, SECRET, Echo, Service, Sleep, make_client, make_server


class RawPeer:
    """A hand-driven connection speaking frames built from the protocol dataclasses."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> RawPeer:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    def send_bytes(self, data: bytes) -> None:
        self.writer.write(data)

    def send(self, frame: Any) -> None:
        body = msgpack.packb(frame)
        self.writer.write(struct.pack(">I", len(body)) + body)

    async def receive(self) -> Any:
        header = await asyncio.wait_for(self.reader.readexactly(4), 5)
        return decode_frame(msgpack.unpackb(await self.reader.readexactly(struct.unpack(">I", header)[0])))

    async def handshake(self, secret: bytes | None = SECRET, cluster_id: str = CLUSTER) -> Any:
        nonce = os.urandom(16)
        self.send(encode_frame(Hello(PROTOCOL_VERSION, "fuzzer", "fuzzer-0", cluster_id, nonce)))
        challenge = await self.receive()
        assert type(challenge) is Challenge
        proof = handshake_proof(secret, b"client", cluster_id, nonce, challenge.server_nonce) if secret else b""
        self.send(encode_frame(Auth(proof)))
        return await self.receive()

    async def is_closed_by_server(self) -> bool:
        try:
            while await asyncio.wait_for(self.reader.read(65536), 5):
                pass
        except ConnectionResetError:
            pass
        return True

    def close(self) -> None:
        self.writer.close()


@pytest.fixture
async def server() -> AsyncIterator[tuple[RpcServer, int, Service]]:
    service = Service()
    rpc_server = make_server(service, max_frame_bytes=64 * 1024, max_inflight_calls=3, handshake_timeout_s=0.5)
    port = await rpc_server.start_tcp("127.0.0.1", 0)
    yield rpc_server, port, service
    service.release.set()
    await rpc_server.stop(1.0)


async def test_dataclass_frames_drive_the_server(server: tuple[RpcServer, int, Service]) -> None:
    _, port, service = server
    peer = await RawPeer.open(port)
    welcome = await peer.handshake()
    assert welcome == Welcome(64 * 1024, 3)
    peer.send(encode_frame(CallFrame(1, ECHO.name, encode_array(Echo("raw", [7])), 5.0)))
    assert await peer.receive() == ResultFrame(1, encode_array(Echo("raw", [7])))
    peer.send(encode_frame(CallFrame(2, BLOCK.name, encode_array(Echo("held", [])), 0.2)))
    peer.send(encode_frame(CancelFrame(2)))
    peer.send(encode_frame(CallFrame(3, ECHO.name, [1, 5, []], 5.0)))
    error = await peer.receive()
    assert type(error) is ErrorFrame and error.id == 3 and error.code == InvalidArgument.code
    assert error.message == "test.echo: Echo.text: expected str, got int"
    # An eager handler that suspended, cancelled before its task ever ran, still sees CancelledError.
    peer.send(encode_frame(CallFrame(4, EAGER_SLEEP.name, encode_array(Sleep(30)), 5.0)))
    peer.send(encode_frame(CancelFrame(4)))
    await asyncio.wait_for(service.cancelled.wait(), 2)
    assert service.num_cancelled == 1
    peer.close()


_KINDS_THAT_CLOSE = {1, 3, 4, 5}  # complete bad frames; a truncated one waits for its rest (or the handshake timeout)


def garbage_frame(rng: random.Random, i: int) -> bytes:
    """One of several kinds of bad input, chosen by i."""
    body = msgpack.packb(encode_frame(CallFrame(1, ECHO.name, [], 1.0)))
    kind = i % 8
    if kind == 0:
        return rng.randbytes(rng.randint(1, 200))
    if kind == 1:
        junk = rng.randbytes(rng.randint(1, 100))
        return struct.pack(">I", len(junk)) + junk
    if kind == 2:
        return (struct.pack(">I", len(body)) + body)[: rng.randint(1, len(body) + 3)]
    if kind == 3:
        return struct.pack(">I", rng.randint(64 * 1024 + 1, 2**32 - 1))
    if kind == 4:
        item = rng.choice([[1, 2], "text", 42, None, b"bytes"])
        return struct.pack(">I", len(msgpack.packb(item))) + msgpack.packb(item)
    if kind == 5:
        frame = msgpack.packb(rng.choice([{"t": "launch", "id": 1}, [7, 1], [CallFrame.TAG, "1", "x", [], 1.0],
                                          [ResultFrame.TAG, 1, []], [], {"t": "call"}]))
        return struct.pack(">I", len(frame)) + frame
    if kind == 6:
        return struct.pack(">I", len(body)) + body  # a call before the handshake
    frame = bytearray(body)
    frame[rng.randrange(len(frame))] = rng.randrange(256)
    return struct.pack(">I", len(frame)) + bytes(frame)


async def test_a_thousand_bad_frames_never_disturb_a_good_client(
        server: tuple[RpcServer, int, Service], caplog: pytest.LogCaptureFixture) -> None:
    rpc_server, port, _ = server
    client = make_client(f"tcp://127.0.0.1:{port}", pool_size=1)
    rng = random.Random(1234)
    num_good_calls = 0
    is_fuzzing = True

    async def well_behaved() -> None:
        nonlocal num_good_calls
        while is_fuzzing:
            reply = await client.call(ECHO, Echo(f"ok {num_good_calls}", [num_good_calls]), timeout_s=5)
            assert reply.token_ids == [num_good_calls]
            num_good_calls += 1

    async def fuzz_one(i: int) -> None:
        peer = await RawPeer.open(port)
        if i % 3 == 0:
            try:
                await peer.handshake()
            except (ConnectionError, asyncio.IncompleteReadError):
                # a loaded machine let its 0.5 s handshake deadline pass first: the server closed it, as it must
                peer.close()
                return
        peer.send_bytes(garbage_frame(rng, i))
        if i % 8 in _KINDS_THAT_CLOSE:
            assert await peer.is_closed_by_server()
        peer.close()

    good = asyncio.ensure_future(well_behaved())
    with caplog.at_level(logging.WARNING, logger="mooncaked.rpc.frames"):
        for start in range(0, 1000, 50):
            await asyncio.gather(*(fuzz_one(i) for i in range(start, start + 50)))
            assert not good.done()
    is_fuzzing = False
    await asyncio.wait_for(good, 5)
    assert num_good_calls > 20
    assert "closing connection" in caplog.text and "malformed frame" in caplog.text
    assert "exceeds the limit" in caplog.text
    for _ in range(100):
        if len(rpc_server.connections) == 1:
            break
        await asyncio.sleep(0.05)
    assert len(rpc_server.connections) == 1  # only the good client's connection is left
    await client.close()


@pytest.mark.parametrize("client_secret, match", [
    (b"wrong-secret", "failed to prove the cluster secret"),  # mutual: the client finds out first
    (None, "requires the cluster secret"),
])
async def test_bad_or_missing_secret_is_refused(server: tuple[RpcServer, int, Service], client_secret: bytes | None,
                                                match: str) -> None:
    _, port, _ = server
    client = make_client(f"tcp://127.0.0.1:{port}", secret=client_secret)
    with pytest.raises(Unauthenticated, match=match):
        await client.call(ECHO, Echo("x", []), timeout_s=5)
    await client.close()


async def test_client_refuses_a_server_that_cannot_prove_the_secret() -> None:
    open_server = RpcServer(role="store", instance="impostor", cluster_id=CLUSTER, secret=None)
    port = await open_server.start_tcp("127.0.0.1", 0)
    client = make_client(f"tcp://127.0.0.1:{port}")
    with pytest.raises(Unauthenticated, match="does not authenticate"):
        await client.call(ECHO, Echo("x", []), timeout_s=5)
    await client.close()
    wrong = RpcServer(role="store", instance="impostor", cluster_id=CLUSTER, secret=b"other")
    port2 = await wrong.start_tcp("127.0.0.1", 0)
    client = make_client(f"tcp://127.0.0.1:{port2}")
    with pytest.raises(Unauthenticated, match="failed to prove"):
        await client.call(ECHO, Echo("x", []), timeout_s=5)
    await client.close()
    await open_server.stop(1.0)
    await wrong.stop(1.0)


async def test_other_cluster_is_refused(server: tuple[RpcServer, int, Service]) -> None:
    _, port, _ = server
    client = make_client(f"tcp://127.0.0.1:{port}", cluster_id="another-cluster")
    with pytest.raises(Unauthenticated, match="cluster id"):
        await client.call(ECHO, Echo("x", []), timeout_s=5)
    await client.close()


async def test_raw_wrong_proof_gets_an_error_frame_then_close(server: tuple[RpcServer, int, Service]) -> None:
    _, port, _ = server
    peer = await RawPeer.open(port)
    reply = await peer.handshake(secret=b"guess")
    assert reply == ErrorFrame(0, Unauthenticated.code, "wrong cluster secret")
    assert await peer.is_closed_by_server()


async def test_oversized_frame_closes_only_that_connection(server: tuple[RpcServer, int, Service]) -> None:
    rpc_server, port, _ = server
    client = make_client(f"tcp://127.0.0.1:{port}", pool_size=1)
    await client.call(ECHO, Echo("before", []), timeout_s=5)
    peer = await RawPeer.open(port)
    await peer.handshake()
    huge = encode_frame(CallFrame(1, ECHO.name, encode_array(Echo("x" * 100_000, [])), 5.0))
    peer.send(huge)
    assert await peer.is_closed_by_server()
    assert (await client.call(ECHO, Echo("after", []), timeout_s=5)).text == "after"
    # The client checks the limit the server announced before sending anything.
    with pytest.raises(ResourceExhausted, match="exceeds the limit"):
        await client.call(ECHO, Echo("x" * 100_000, []), timeout_s=5)
    assert (await client.call(ECHO, Echo("still", []), timeout_s=5)).text == "still"
    await client.close()


async def test_max_inflight_calls_per_connection(server: tuple[RpcServer, int, Service]) -> None:
    rpc_server, port, service = server
    client = make_client(f"tcp://127.0.0.1:{port}", pool_size=1)
    held = [asyncio.ensure_future(client.call(BLOCK, Echo(str(i), []), timeout_s=10)) for i in range(3)]
    while service.num_started < 3:
        await asyncio.sleep(0.01)
    with pytest.raises(ResourceExhausted, match="3 calls already in flight"):
        await client.call(BLOCK, Echo("one too many", []), timeout_s=5)
    assert rpc_server.num_inflight_calls == 3
    service.release.set()
    assert [(await call).text for call in held] == ["0", "1", "2"]
    assert (await client.call(ECHO, Echo("room again", []), timeout_s=5)).text == "room again"
    await client.close()


async def test_unknown_method_is_not_found_and_closes_the_connection(
        server: tuple[RpcServer, int, Service]) -> None:
    _, port, _ = server
    peer = await RawPeer.open(port)
    await peer.handshake()
    peer.send(encode_frame(CallFrame(1, "no.such.method", [], 5.0)))
    reply = await peer.receive()
    assert type(reply) is ErrorFrame and reply.code == NotFound.code
    assert await peer.is_closed_by_server()


async def test_silent_connection_is_closed_after_the_handshake_timeout(
        server: tuple[RpcServer, int, Service]) -> None:
    rpc_server, port, _ = server
    peer = await RawPeer.open(port)
    loop = asyncio.get_running_loop()
    began = loop.time()
    assert await peer.is_closed_by_server()
    assert 0.3 < loop.time() - began < 3


@pytest.mark.parametrize("timeout_s", [float("inf"), float("nan"), 1e12])
async def test_a_deadline_without_end_is_refused_and_the_connection_lives(
        server: tuple[RpcServer, int, Service], timeout_s: float) -> None:
    _, port, _ = server
    peer = await RawPeer.open(port)
    await peer.handshake()
    peer.send(encode_frame(CallFrame(1, ECHO.name, encode_array(Echo("forever", [])), timeout_s)))
    reply = await peer.receive()
    assert type(reply) is ErrorFrame and reply.code == InvalidArgument.code and "timeout_s" in reply.message
    peer.send(encode_frame(CallFrame(2, ECHO.name, encode_array(Echo("bounded", [])), 5.0)))
    assert await peer.receive() == ResultFrame(2, encode_array(Echo("bounded", [])))
    peer.close()


async def test_client_refuses_to_send_a_call_without_a_deadline(server: tuple[RpcServer, int, Service]) -> None:
    _, port, _ = server
    client = make_client(f"tcp://127.0.0.1:{port}", pool_size=1)
    for timeout_s in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match="every RPC needs a deadline"):
            await client.call(ECHO, Echo("x", []), timeout_s=timeout_s)
    assert (await client.call(ECHO, Echo("fine", []), timeout_s=5)).text == "fine"
    await client.close()


async def test_a_connect_every_caller_gave_up_on_fails_without_an_unretrieved_exception() -> None:
    """The caller's deadline passes before the connect attempts end: the attempt's later failure is nobody's
    error, and the event loop must not report it as an exception never retrieved."""
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: reported.append(context))
    client = RpcClient(f"tcp://127.0.0.1:{free_port()}", role="test", instance="t", cluster_id=CLUSTER, secret=None,
                       connect_timeout_s=0.2)
    with pytest.raises(DeadlineExceeded):
        await client.call(ECHO, Echo("x", []), timeout_s=0.01)
    attempts = [task for task in client._connect_tasks if task is not None]
    await asyncio.wait(attempts, timeout=5.0)
    assert all(task.done() for task in attempts)
    client._connect_tasks = [None] * len(client._connect_tasks)
    del attempts
    gc.collect()
    assert not reported, reported
    await client.close()
