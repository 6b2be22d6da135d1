"""The data port trusts no one by default: every connection proves the cluster id and, when configured, the
cluster secret before any READ, WRITE or CONTROL frame is served; bytes that are not a handshake read and write
nothing and harm no other connection."""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mooncaked.runtime import auth
from mooncaked.transfer import SegmentRef, TransferEngine, TransferError, TransferOp, TransferRequest
from mooncaked.transfer import wire
from mooncaked.transfer.control import DescribeRequest, TcpControlChannel, encode_control
from mooncaked.transfer.handshake import (DATA_AUTH_LABEL, HANDSHAKE_TAG, HELLO, MAGIC, DataCredentials, HandshakeRefused,
                                          client_handshake, serve_handshake)
from mooncaked.transfer.tcp_server import MAX_HANDSHAKES_PER_ADDRESS
from mooncaked.transfer.types import split_endpoint

SECRET = b"correct horse battery staple"
CLUSTER = "auth-test"
SEGMENT = bytes(range(256)) * 16  # 4 KiB a peer must never read without the secret


@pytest.fixture
async def server() -> AsyncIterator[TransferEngine]:
    engine = TransferEngine(host="127.0.0.1", cluster_id=CLUSTER, secret=SECRET, connect_timeout_s=1.0)
    await engine.start()
    engine.register("pool", bytearray(SEGMENT))
    yield engine
    await engine.stop()


async def transfer(server: TransferEngine, op: TransferOp, *, cluster_id: str = CLUSTER,
                   secret: bytes | None = SECRET) -> bytearray:
    """One 4 KiB READ or WRITE from a client engine on another loopback address; returns its local buffer."""
    client = TransferEngine(host="127.0.0.2", cluster_id=cluster_id, secret=secret, max_retries=1)
    await client.start()
    try:
        local = bytearray(b"\xee" * len(SEGMENT))
        client.register("local", local)
        batch = client.submit([TransferRequest(op, "local", 0, SegmentRef(server.endpoint, "pool"), 0, len(SEGMENT))])
        await client.wait(batch, timeout_s=10)
        return local
    finally:
        await client.stop()


def pool_bytes(engine: TransferEngine) -> bytes:
    return bytes(engine._segments.view("pool", 0, len(SEGMENT)))


async def test_the_right_secret_is_served(server: TransferEngine) -> None:
    assert await transfer(server, TransferOp.READ) == SEGMENT
    await transfer(server, TransferOp.WRITE)
    assert pool_bytes(server) == b"\xee" * len(SEGMENT)


@pytest.mark.parametrize(("cluster_id", "secret", "error"), [
    (CLUSTER, None, "requires the cluster secret"),
    (CLUSTER, b"wrong secret", "failed to prove the cluster secret"),
    ("another-cluster", SECRET, "cluster id is not this engine's"),
])
async def test_a_peer_without_the_credentials_reads_and_writes_nothing(
    server: TransferEngine, cluster_id: str, secret: bytes | None, error: str,
) -> None:
    for op in (TransferOp.READ, TransferOp.WRITE):
        with pytest.raises(TransferError, match=error):
            await transfer(server, op, cluster_id=cluster_id, secret=secret)
    assert pool_bytes(server) == SEGMENT


async def test_a_client_with_a_secret_refuses_a_server_without_one() -> None:
    open_server = TransferEngine(host="127.0.0.1", cluster_id=CLUSTER)
    await open_server.start()
    open_server.register("pool", bytearray(SEGMENT))
    try:
        with pytest.raises(TransferError, match="does not authenticate"):
            await transfer(open_server, TransferOp.WRITE)
        assert pool_bytes(open_server) == SEGMENT
        assert await transfer(open_server, TransferOp.READ, secret=None) == SEGMENT  # both open: served
    finally:
        await open_server.stop()


def raw_connection(engine: TransferEngine) -> socket.socket:
    sock = socket.create_connection(split_endpoint(engine.endpoint), timeout=5)
    wire.set_io_timeout(sock, 5)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    received = bytearray()
    while True:
        try:
            chunk = sock.recv(1 << 16)
        except ConnectionResetError:
            return bytes(received)
        if not chunk:
            return bytes(received)
        received += chunk


async def test_a_segment_name_alone_reads_nothing(server: TransferEngine) -> None:
    with raw_connection(server) as sock:
        sock.sendall(wire.encode_request(wire.OP_READ, "pool", 1, 0, len(SEGMENT)))
        answer = read_until_closed(sock)
    tag, status, message_len = wire.REPLY.unpack_from(answer)
    assert (tag, status) == (HANDSHAKE_TAG, wire.STATUS_UNAUTHENTICATED)
    assert b"handshake" in answer[wire.REPLY.size:]
    assert len(answer) == wire.REPLY.size + message_len, "one error reply, then the connection closed"
    assert SEGMENT[:64] not in answer


async def test_rdma_control_messages_need_the_handshake_too(server: TransferEngine) -> None:
    request = encode_control(DescribeRequest(["pool"]))
    assert TcpControlChannel(DataCredentials(CLUSTER, SECRET)).exchange(server.endpoint, request, 5)
    with pytest.raises(HandshakeRefused, match="requires the cluster secret"):
        TcpControlChannel(DataCredentials(CLUSTER)).exchange(server.endpoint, request, 5)
    with raw_connection(server) as sock:  # an OP_CONTROL frame without the handshake
        sock.sendall(wire.REQUEST.pack(wire.WIRE_VERSION, wire.OP_CONTROL, 0, 0, 1, 0, len(request)) + request)
        answer = read_until_closed(sock)
    assert wire.REPLY.unpack_from(answer)[1] == wire.STATUS_UNAUTHENTICATED


async def test_a_silent_peer_is_cut_off_at_the_handshake_deadline(server: TransferEngine) -> None:
    with raw_connection(server) as sock:
        started = time.monotonic()
        assert read_until_closed(sock) == b""
        assert 0.5 < time.monotonic() - started < 4.0  # connect_timeout_s=1.0 bounds the handshake


def test_proofs_are_bound_to_side_protocol_cluster_and_nonces() -> None:
    nonces = (auth.new_nonce(), auth.new_nonce())
    proof = auth.handshake_proof(SECRET, DATA_AUTH_LABEL, auth.SIDE_CLIENT, CLUSTER, *nonces)
    assert len(proof) == auth.PROOF_BYTES
    others = [
        auth.handshake_proof(SECRET, DATA_AUTH_LABEL, auth.SIDE_SERVER, CLUSTER, *nonces),
        auth.handshake_proof(SECRET, b"mooncaked-rpc-v1", auth.SIDE_CLIENT, CLUSTER, *nonces),
        auth.handshake_proof(SECRET, DATA_AUTH_LABEL, auth.SIDE_CLIENT, "other", *nonces),
        auth.handshake_proof(SECRET, DATA_AUTH_LABEL, auth.SIDE_CLIENT, CLUSTER, nonces[1], nonces[0]),
        auth.handshake_proof(b"other", DATA_AUTH_LABEL, auth.SIDE_CLIENT, CLUSTER, *nonces),
    ]
    assert not any(auth.proofs_match(proof, other) for other in others)
    assert DataCredentials(CLUSTER, SECRET).__repr__().count("staple") == 0, "the secret is never printed"


def test_handshake_over_a_socket_pair_both_ways() -> None:
    for client_secret, server_secret, accepted in [(SECRET, SECRET, True), (None, None, True),
                                                   (None, SECRET, False), (SECRET, b"x", False)]:
        left, right = socket.socketpair()
        with left, right:
            wire.set_io_timeout(left, 5)
            wire.set_io_timeout(right, 5)
            refusal: list[str] = []

            def serve(secret: bytes | None = server_secret) -> None:
                try:
                    refusal.append(serve_handshake(right, DataCredentials(CLUSTER, secret)))
                except OSError as exc:  # the client refused the server first and closed
                    refusal.append(f"closed: {exc}")

            thread = threading.Thread(target=serve)
            thread.start()
            try:
                client_handshake(left, DataCredentials(CLUSTER, client_secret), "peer")
                is_accepted = True
            except HandshakeRefused:
                left.close()
                is_accepted = False
            thread.join(5)
            assert is_accepted is accepted
            assert (refusal == [""]) is accepted


hostile_first_bytes = st.one_of(
    st.binary(max_size=200),
    st.builds(lambda version, length, nonce, tail: HELLO.pack(MAGIC, version, length, nonce) + tail,
              st.integers(0, 255), st.integers(0, 0xFFFF), st.binary(min_size=16, max_size=16),
              st.binary(max_size=64)),
    st.builds(lambda tail: HELLO.pack(MAGIC, wire.WIRE_VERSION, len(CLUSTER), bytes(16)) + CLUSTER.encode() + tail,
              st.binary(max_size=80)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(first_bytes=hostile_first_bytes)
async def test_hostile_bytes_never_reach_a_segment(server: TransferEngine, first_bytes: bytes) -> None:
    # The data server runs on its own threads: blocking sockets here do not stall it.
    with raw_connection(server) as sock:
        try:
            sock.sendall(first_bytes)
            sock.shutdown(socket.SHUT_WR)  # no more bytes: the server must answer or close, never wait forever
        except OSError:
            pass
        answer = read_until_closed(sock)
    assert SEGMENT[:64] not in answer
    replies = parse_replies(answer)
    challenge_bytes = auth.NONCE_BYTES + auth.PROOF_BYTES
    statuses = [status for status, _ in replies]
    assert statuses.count(wire.STATUS_OK) <= 1, "at most the challenge, never the welcome"
    assert all(status == wire.STATUS_OK for status in statuses[:-1]), "an error reply is the last word"
    if replies and replies[0][0] == wire.STATUS_OK:
        assert len(replies[0][1]) == challenge_bytes
    if replies[-1:] and replies[-1][0] != wire.STATUS_OK:
        assert replies[-1][0] in (wire.STATUS_BAD_REQUEST, wire.STATUS_UNAUTHENTICATED)
    assert pool_bytes(server) == SEGMENT
    assert _authenticated_read(server) == SEGMENT[:16], "other connections are unharmed"


def parse_replies(answer: bytes) -> list[tuple[int, bytes]]:
    replies, position = [], 0
    while position + wire.REPLY.size <= len(answer):
        tag, status, message_len = wire.REPLY.unpack_from(answer, position)
        assert tag == HANDSHAKE_TAG
        position += wire.REPLY.size + message_len
        replies.append((status, answer[position - message_len:position]))
    assert position == len(answer), "nothing but whole replies"
    return replies


def _authenticated_read(engine: TransferEngine) -> bytes:
    with raw_connection(engine) as sock:
        client_handshake(sock, DataCredentials(CLUSTER, SECRET), engine.endpoint)
        sock.sendall(wire.encode_request(wire.OP_READ, "pool", 1, 0, 16))
        status, message = wire.recv_reply(sock, 1)
        assert status == wire.STATUS_OK, message
        payload = bytearray(16)
        wire.recv_exactly(sock, memoryview(payload))
        return bytes(payload)


def test_hello_layout_is_stable() -> None:
    assert HELLO.size == 24 and struct.calcsize("<B32s") == 33


async def test_silent_connections_from_one_address_are_capped(server: TransferEngine,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="mooncaked.transfer.tcp_server")
    silent = [raw_connection(server) for _ in range(MAX_HANDSHAKES_PER_ADDRESS)]
    try:
        time.sleep(0.2)  # the accept thread has counted them
        with raw_connection(server) as extra:
            started = time.monotonic()
            assert read_until_closed(extra) == b""
            assert time.monotonic() - started < 0.5, "closed as accepted, not at the handshake deadline"
        assert sum("have not completed the handshake" in r.getMessage() for r in caplog.records) == 1
    finally:
        for sock in silent:
            sock.close()
    deadline = time.monotonic() + 5
    while True:  # once they are gone, the address is served again
        try:
            assert _authenticated_read(server) == SEGMENT[:16]
            break
        except (HandshakeRefused, OSError):
            assert time.monotonic() < deadline
            time.sleep(0.05)


@pytest.fixture
async def strict_server() -> AsyncIterator[TransferEngine]:
    """A server whose data connections must progress within 0.3 s inside a frame and are closed after 1 s idle."""
    engine = TransferEngine(host="127.0.0.1", cluster_id=CLUSTER, secret=SECRET, connect_timeout_s=1.0,
                            io_timeout_s=0.3, idle_timeout_s=1.0)
    await engine.start()
    engine.register("pool", bytearray(SEGMENT))
    yield engine
    await engine.stop()


async def test_a_peer_that_stalls_inside_a_frame_is_cut_off(strict_server: TransferEngine) -> None:
    with raw_connection(strict_server) as sock:
        client_handshake(sock, DataCredentials(CLUSTER, SECRET), strict_server.endpoint)
        sock.sendall(wire.encode_request(wire.OP_WRITE, "pool", 1, 0, 4096) + b"x" * 10)  # then nothing more
        started = time.monotonic()
        assert read_until_closed(sock) == b""
        assert time.monotonic() - started < 0.9, "cut off after io_timeout_s, not at the idle timeout"
    assert _authenticated_read(strict_server)[10:] == SEGMENT[10:16], "the server goes on serving the others"


async def test_an_idle_connection_is_closed_after_the_idle_timeout(strict_server: TransferEngine) -> None:
    with raw_connection(strict_server) as sock:
        client_handshake(sock, DataCredentials(CLUSTER, SECRET), strict_server.endpoint)
        started = time.monotonic()
        assert read_until_closed(sock) == b""
        assert 0.8 < time.monotonic() - started < 3.0


async def test_a_client_never_reuses_a_connection_the_server_may_have_closed(
        strict_server: TransferEngine) -> None:
    client = TransferEngine(host="127.0.0.2", cluster_id=CLUSTER, secret=SECRET, max_retries=0,
                            num_connections_per_peer=1, io_timeout_s=0.3, idle_timeout_s=1.0)
    await client.start()
    try:
        local = bytearray(len(SEGMENT))
        client.register("local", local)
        request = TransferRequest(TransferOp.READ, "local", 0, SegmentRef(strict_server.endpoint, "pool"), 0,
                                  len(SEGMENT))
        await client.wait(client.submit([request]), timeout_s=10)
        time.sleep(1.3)  # the server closed the idle connection meanwhile
        local[:] = bytes(len(SEGMENT))
        await client.wait(client.submit([request]), timeout_s=10)  # no retry allowed: a fresh connection
        assert bytes(local) == SEGMENT
    finally:
        await client.stop()
