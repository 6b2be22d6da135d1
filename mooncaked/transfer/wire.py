"""The data-connection wire format (TCP transport), version 2.

0. Every connection starts with the handshake of handshake.py (cluster id, and the cluster secret when one is
   configured); only then are frames served.
1. The client sends a request header, the segment name, and for WRITE `length` payload bytes.
2. The server answers with a reply header and an error message (empty when ok); for an ok READ the
   `length` payload bytes follow the reply header.
3. `tag` echoes the client's frame id so a reply can be matched to its request.

Request header (32 bytes, little-endian): version u8, op u8, name_len u16, reserved u32, tag u64, offset u64,
length u64. Reply header (16 bytes): tag u64, status u8, 3 pad bytes, message_len u32.

Sockets are blocking (timeouts, where wanted, are the kernel's SO_SNDTIMEO/SO_RCVTIMEO): a whole frame then
moves in one `sendmsg` and one `recv_into(..., MSG_WAITALL)`, the GIL released throughout. A Python-level
socket timeout would instead poll before every partial send/recv and take the GIL back each time (measured
with 4 MiB frames under strace: 2.3x the socket calls and 3x the futex calls per GiB).
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

WIRE_VERSION = 2
OP_READ = 1
OP_WRITE = 2
OP_CONTROL = 3  # payload: a control message (e.g. RDMA queue-pair info); reply message carries the answer

STATUS_OK = 0
STATUS_BAD_REQUEST = 1  # not retryable: unknown segment, out of bounds, bad version
STATUS_INTERNAL = 2
STATUS_UNAUTHENTICATED = 3  # the handshake failed: the connection closes after this reply

REQUEST = struct.Struct("<BBHIQQQ")
REPLY = struct.Struct("<QB3xI")
MAX_NAME_BYTES = 1024
MAX_MESSAGE_BYTES = 1 << 20


@dataclass(frozen=True)
class RequestHeader:
    op: int
    name: str
    tag: int
    offset: int
    length: int


class RemoteRejected(Exception):
    """The server refused a frame (not retryable on another path)."""


def encode_request(op: int, name: str, tag: int, offset: int, length: int) -> bytes:
    name_bytes = name.encode()
    return REQUEST.pack(WIRE_VERSION, op, len(name_bytes), 0, tag, offset, length) + name_bytes


def set_send_buffer(sock: socket.socket, num_bytes: int) -> None:
    """Cap the kernel send buffer of `sock` (0 leaves the kernel's autotuning in place)."""
    if num_bytes > 0:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, num_bytes)


def set_io_timeout(sock: socket.socket, timeout_s: float) -> None:
    """Make `sock` blocking, with a kernel timeout on each send and receive call: a call that moves no byte
    for `timeout_s` raises TimeoutError (one that moved some returns them, and the next call waits afresh)."""
    sock.settimeout(None)
    micros = max(int(timeout_s * 1e6), 1)  # a zero timeval would mean "no timeout"
    timeval = struct.pack("@ll", micros // 1_000_000, micros % 1_000_000)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)


def send_all(sock: socket.socket, buffers: list[memoryview]) -> None:
    """Send `buffers` back to back, in one `sendmsg` unless the kernel takes them partially."""
    while buffers:
        num_sent = _timed(sock.sendmsg, buffers)
        while buffers and num_sent >= buffers[0].nbytes:
            num_sent -= buffers[0].nbytes
            buffers.pop(0)
        if buffers and num_sent:
            buffers[0] = buffers[0][num_sent:]


def _timed(call: Callable[..., int], *args: Any) -> int:
    """`call(*args)`; TimeoutError when the kernel timeout of `set_io_timeout` passes without progress."""
    try:
        return call(*args)
    except BlockingIOError as exc:
        raise TimeoutError("no progress on the data connection within io_timeout_s") from exc


def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from `sock`; ConnectionError if the peer closes first."""
    while view.nbytes:
        num_received = _timed(sock.recv_into, view, 0, socket.MSG_WAITALL)
        if num_received == 0:
            raise ConnectionError("peer closed the connection")
        view = view[num_received:]


def recv_request_header(sock: socket.socket, scratch: bytearray) -> RequestHeader | None:
    """The next request header, or None on a clean close before it."""
    head = memoryview(scratch)[: REQUEST.size]
    first = _timed(sock.recv_into, head, 0, socket.MSG_WAITALL)
    if first == 0:
        return None
    recv_exactly(sock, head[first:])
    version, op, name_len, _, tag, offset, length = REQUEST.unpack(head)
    if version != WIRE_VERSION:
        raise ConnectionError(f"wire version {version} is not supported (this side speaks {WIRE_VERSION})")
    if name_len > MAX_NAME_BYTES:
        raise ConnectionError(f"segment name of {name_len} bytes exceeds {MAX_NAME_BYTES}")
    name_view = memoryview(scratch)[REQUEST.size : REQUEST.size + name_len]
    recv_exactly(sock, name_view)
    return RequestHeader(op, bytes(name_view).decode(), tag, offset, length)


def send_reply(sock: socket.socket, tag: int, status: int, message: str = "") -> None:
    send_reply_bytes(sock, tag, status, message.encode())


def send_reply_bytes(sock: socket.socket, tag: int, status: int, message: bytes) -> None:
    message = message[:MAX_MESSAGE_BYTES]
    sock.sendall(REPLY.pack(tag, status, len(message)) + message)


def recv_reply(sock: socket.socket, expected_tag: int) -> tuple[int, str]:
    """(status, message) of the next reply; ConnectionError on a protocol violation."""
    status, message = recv_reply_bytes(sock, expected_tag)
    return status, message.decode(errors="replace")


def recv_reply_bytes(sock: socket.socket, expected_tag: int) -> tuple[int, bytes]:
    """(status, raw message) of the next reply; ConnectionError on a protocol violation."""
    head = bytearray(REPLY.size)
    recv_exactly(sock, memoryview(head))
    tag, status, message_len = REPLY.unpack(head)
    if tag != expected_tag:
        raise ConnectionError(f"reply for frame {tag} while waiting for frame {expected_tag}")
    if message_len > MAX_MESSAGE_BYTES:
        raise ConnectionError(f"reply message of {message_len} bytes exceeds {MAX_MESSAGE_BYTES}")
    message = bytearray(message_len)
    recv_exactly(sock, memoryview(message))
    return status, bytes(message)


def drain(sock: socket.socket, num_bytes: int, scratch: bytearray) -> None:
    """Read and drop `num_bytes` (a refused WRITE's payload) to keep the stream in step."""
    view = memoryview(scratch)
    while num_bytes > 0:
        chunk = view[: min(num_bytes, len(view))]
        recv_exactly(sock, chunk)
        num_bytes -= chunk.nbytes
