"""Hostile RPC input, generated with hypothesis: arbitrary bytes before the handshake, arbitrary msgpack values as
frames after it, and call frames with arbitrary arguments, against a live RPC server and a live store. The
property: a typed error reply (never `internal`) or a closed connection; never an unhandled exception, a hang,
or harm to other connections."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import struct
import typing
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mooncaked.rpc import Internal, RpcServer
from mooncaked.rpc.protocol import CallFrame, ErrorFrame, ItemFrame, ResultFrame, EndFrame, encode_array, encode_frame
from mooncaked.store import messages as store_messages
from tests.roles.cluster_fixtures import cluster_config, instance, running_roles
from tests.rpc.test_rpc import ECHO, SECRET, Echo, Service, make_client, make_server
from tests.rpc.test_rpc_faults import RawPeer

HYPOTHESIS = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
PROBE_ID = 2**53  # above any id a hostile frame gives, so the probe call is always in order
UNEXPECTED = "unexpected failure handling frames"

msgpack_scalars = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats()
                   | st.text(st.characters(codec="utf-8"), max_size=16) | st.binary(max_size=24))
msgpack_values = st.recursive(
    msgpack_scalars,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=4) | st.integers(0, 9),
                                                                       children, max_size=4),
    max_leaves=20)
# What our framing accepts as a frame: map keys are strings (int keys are a malformed frame: the connection closes)
frame_values = st.recursive(
    msgpack_scalars,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=4), children, max_size=4),
    max_leaves=20)
call_frames = st.builds(lambda call_id, name, args, timeout: [CallFrame.TAG, call_id, name, args, timeout],
                        st.integers(-2, 2**40) | msgpack_scalars, st.just(ECHO.name) | st.text(max_size=12),
                        msgpack_values, st.floats() | st.integers(-5, 10**9) | msgpack_scalars)


def frame_bytes(value: Any) -> bytes:
    body = msgpack.packb(value)
    return struct.pack(">I", len(body)) + body


async def replies_until_probe_or_close(peer: RawPeer, probe_id: int) -> tuple[list[Any], bool]:
    """(every frame received, whether the connection survived): reads until the probe's answer or a close."""
    frames: list[Any] = []
    while True:
        try:
            frame = await peer.receive()
        except (asyncio.IncompleteReadError, ConnectionResetError):
            return frames, False
        frames.append(frame)
        if getattr(frame, "id", None) == probe_id and type(frame) in (ResultFrame, ErrorFrame):
            return frames, True


def assert_typed(frames: list[Any]) -> None:
    for frame in frames:
        assert type(frame) in (ResultFrame, ErrorFrame, ItemFrame, EndFrame), frame
        if type(frame) is ErrorFrame:
            assert frame.code != Internal.code, frame


@pytest.fixture
async def server() -> AsyncIterator[tuple[RpcServer, int]]:
    service = Service()
    rpc_server = make_server(service, max_frame_bytes=64 * 1024, handshake_timeout_s=0.5)
    port = await rpc_server.start_tcp("127.0.0.1", 0)
    yield rpc_server, port
    service.release.set()
    await rpc_server.stop(1.0)


@settings(HYPOTHESIS, max_examples=150)
@given(raw=st.binary(max_size=300) | msgpack_values.map(frame_bytes) | call_frames.map(frame_bytes))
async def test_any_bytes_before_the_handshake_close_the_connection(
    server: tuple[RpcServer, int], raw: bytes, caplog: pytest.LogCaptureFixture,
) -> None:
    _, port = server
    peer = await RawPeer.open(port)
    peer.send_bytes(raw)
    peer.writer.write_eof()  # nothing more: the server must answer and close, or just close, never wait
    assert await asyncio.wait_for(peer.is_closed_by_server(), 10)
    peer.close()
    assert UNEXPECTED not in caplog.text


@settings(HYPOTHESIS, max_examples=150)
@given(frame=msgpack_values | call_frames)
async def test_any_frame_after_the_handshake_gets_a_typed_error_or_a_close(
    server: tuple[RpcServer, int], frame: Any, caplog: pytest.LogCaptureFixture,
) -> None:
    rpc_server, port = server
    peer = await RawPeer.open(port)
    await peer.handshake()
    peer.send_bytes(frame_bytes(frame))
    peer.send(encode_frame(CallFrame(PROBE_ID, ECHO.name, encode_array(Echo("probe", [1])), 5.0)))
    frames, is_open = await asyncio.wait_for(replies_until_probe_or_close(peer, PROBE_ID), 10)
    assert_typed(frames)
    if is_open:
        assert frames[-1] == ResultFrame(PROBE_ID, encode_array(Echo("probe", [1])))
    peer.close()
    assert UNEXPECTED not in caplog.text
    client = make_client(f"tcp://127.0.0.1:{port}", secret=SECRET)
    assert (await client.call(ECHO, Echo("unharmed", [2]), timeout_s=5)).text == "unharmed"
    await client.close()


def plausible(hint: Any) -> st.SearchStrategy[Any]:
    """Values of a message field's type, near and past its edges, or anything at all."""
    origin = typing.get_origin(hint)
    if hint is bytes:
        return st.binary(min_size=16, max_size=16) | st.binary(max_size=40)
    if hint is int:
        return st.integers(-2**63, 2**64 - 1) | st.integers(-3, 3) | st.just(2**63 - 1)
    if hint is float:
        return st.floats()
    if hint is str:
        return st.text(max_size=12)
    if hint is bool:
        return st.booleans()
    if origin is list:
        return st.lists(plausible(typing.get_args(hint)[0]), max_size=6)
    return frame_values


def store_call_args(method: Any) -> st.SearchStrategy[list[Any]]:
    hints = typing.get_type_hints(method.request)
    fields = [plausible(hints[f.name]) | frame_values for f in dataclasses.fields(method.request)]
    return st.tuples(*fields).map(list) | frame_values


STORE_METHODS = [store_messages.ALLOCATE, store_messages.COMMIT, store_messages.ABORT, store_messages.LOOKUP,
                 store_messages.RELEASE, store_messages.PIN, store_messages.UNPIN, store_messages.STATS,
                 store_messages.DUMP, store_messages.EVENTS, store_messages.MARK_SPARE]
store_calls = st.sampled_from(STORE_METHODS).flatmap(
    lambda method: st.tuples(st.just(method.name), store_call_args(method), st.floats(0.001, 2.0)))


@pytest.fixture
async def live_store(tmp_path: Path) -> AsyncIterator[tuple[int, str]]:
    config = cluster_config(tmp_path, [instance("s0", "store")], store={"dram_bytes": 4 << 20})
    async with running_roles(config, ["s0"]) as roles:
        yield roles["s0"].endpoint.bound_port, config.cluster.id  # type: ignore[attr-defined]


@settings(HYPOTHESIS, max_examples=120)
@given(calls=st.lists(store_calls, min_size=1, max_size=4))
async def test_a_live_store_answers_any_call_with_a_result_or_a_typed_error(
    live_store: tuple[int, str], calls: list[tuple[str, list[Any], float]], caplog: pytest.LogCaptureFixture,
) -> None:
    port, cluster_id = live_store
    peer = await RawPeer.open(port)
    await peer.handshake(secret=None, cluster_id=cluster_id)
    for call_id, (name, args, timeout_s) in enumerate(calls, start=1):
        peer.send(encode_frame(CallFrame(call_id, name, args, timeout_s)))
    stats = encode_array(store_messages.StatsRequest())
    peer.send(encode_frame(CallFrame(PROBE_ID, store_messages.STATS.name, stats, 5.0)))
    frames, is_open = await asyncio.wait_for(replies_until_probe_or_close(peer, PROBE_ID), 15)
    assert_typed(frames)
    assert is_open and type(frames[-1]) is ResultFrame, "a well-formed call frame never closes the connection"
    peer.close()
    assert UNEXPECTED not in caplog.text and "failed on store" not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
