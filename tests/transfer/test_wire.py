"""Data-connection frames round-trip over a socket pair; a wrong version or tag is a connection error."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from mooncaked.transfer import wire


def test_request_and_reply_round_trip() -> None:
    left, right = socket.socketpair()
    with left, right:
        left.sendall(wire.encode_request(wire.OP_WRITE, "pool/ü", 7, 1 << 40, 12345))
        scratch = bytearray(wire.REQUEST.size + wire.MAX_NAME_BYTES)
        expected = wire.RequestHeader(wire.OP_WRITE, "pool/ü", 7, 1 << 40, 12345)
        assert wire.recv_request_header(right, scratch) == expected
        wire.send_reply(right, 7, wire.STATUS_BAD_REQUEST, "range [0, 9) is outside segment 'x'")
        assert wire.recv_reply(left, 7) == (wire.STATUS_BAD_REQUEST, "range [0, 9) is outside segment 'x'")
        left.close()
        assert wire.recv_request_header(right, scratch) is None, "a clean close between frames"


def test_protocol_violations_are_connection_errors() -> None:
    left, right = socket.socketpair()
    with left, right:
        scratch = bytearray(wire.REQUEST.size + wire.MAX_NAME_BYTES)
        left.sendall(wire.REQUEST.pack(9, wire.OP_READ, 0, 0, 1, 0, 0))
        with pytest.raises(ConnectionError, match="wire version 9 is not supported"):
            wire.recv_request_header(right, scratch)
        wire.send_reply(right, 3, wire.STATUS_OK)
        with pytest.raises(ConnectionError, match="reply for frame 3 while waiting for frame 4"):
            wire.recv_reply(left, 4)


def test_send_all_moves_header_and_payload_across_partial_sends() -> None:
    left, right = socket.socketpair()
    with left, right:
        left.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # forces many partial sendmsg calls
        payload = bytes(range(256)) * 4096  # 1 MiB
        received = bytearray(len(payload) + 3)
        reader = threading.Thread(target=wire.recv_exactly, args=(right, memoryview(received)))
        reader.start()
        wire.send_all(left, [memoryview(b"hdr"), memoryview(payload)])
        reader.join(10)
        assert bytes(received) == b"hdr" + payload


def test_io_timeout_turns_a_stalled_peer_into_timeout_error() -> None:
    left, right = socket.socketpair()
    with left, right:
        wire.set_io_timeout(left, 0.2)
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="io_timeout_s"):
            wire.recv_reply(left, 1)
        assert 0.15 < time.monotonic() - started < 2.0
        wire.set_send_buffer(left, 4096)
        with pytest.raises(TimeoutError, match="io_timeout_s"):
            wire.send_all(left, [memoryview(bytearray(64 << 20))])  # nobody reads on the right
