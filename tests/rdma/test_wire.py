"""Data-connection frames round-trip over a socket pair; a wrong version or tag is a connection error."""

from __future__ import annotations

import socket

import pytest

from mooncaked.rdma import wire


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
