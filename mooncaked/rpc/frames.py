"""Framing shared by the RPC server and client: length-prefixed msgpack over an asyncio.Protocol.

Lifecycle of a connection's bytes:
  1. data_received appends to a read buffer (or parses the chunk in place when nothing is buffered);
     each frame is a 4-byte big-endian length then one msgpack value of at most max_frame_bytes.
  2. Every complete frame goes to `on_frame`, which checks its shape; a frame that is oversized or not
     msgpack closes the connection with a logged reason (`close_with_reason`), never raising into the loop.
  3. `send_frame` packs a frame into a write list; all frames produced in one loop iteration (or one
     data_received) leave in one transport.write, so 64 in-flight calls cost a few syscalls, not 128.
  4. connection_lost marks the connection closed and wakes anyone waiting to drain.

DeadlineWheel keeps per-call deadlines in coarse buckets served by one loop timer, because on this
project's machines a loop timer costs as much as a whole call.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import struct
from typing import Any, Callable, cast

import msgpack

from mooncaked.rpc.errors import ResourceExhausted
from mooncaked.runtime import auth

logger = logging.getLogger(__name__)

HEADER = struct.Struct(">I")  # a frame's body length, big-endian
HEADER_BYTES = HEADER.size
DEFAULT_MAX_FRAME_BYTES = 4 << 20
HANDSHAKE_MAX_FRAME_BYTES = 4096
NONCE_BYTES = auth.NONCE_BYTES
RPC_AUTH_LABEL = b"mooncaked-rpc-v1"
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # the longest deadline a call may carry: every wait ends


def check_timeout(timeout_s: float) -> None:
    """Raise ValueError unless timeout_s is a number of seconds no larger than MAX_TIMEOUT_S (NaN and inf fail)."""
    if not timeout_s <= MAX_TIMEOUT_S:
        raise ValueError(f"timeout_s must be a finite number of seconds <= {MAX_TIMEOUT_S:.0f}, got {timeout_s!r}: "
                         "every RPC needs a deadline")


class FramedProtocol(asyncio.Protocol):
    """Owns one transport, its read buffer and its pending writes; subclasses implement on_frame."""

    def __init__(self, max_frame_bytes: int) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self.max_frame_bytes = max_frame_bytes
        self.is_closed = False
        self._read_buffer = bytearray()
        self._write_chunks: list[bytes] = []
        self._is_flush_pending = False
        self._packer = msgpack.Packer()
        self._drain_waiter: asyncio.Future[None] | None = None
        self._is_write_paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it
        self.peer = str(transport.get_extra_info("peername") or transport.get_extra_info("sockname") or "?")

    def connection_lost(self, exc: Exception | None) -> None:
        self.is_closed = True
        self._write_chunks.clear()
        self._wake_drain()

    def on_frame(self, frame: Any) -> None:
        """One unpacked frame, of any msgpack type: the subclass checks it (close_with_reason if bad)."""
        raise NotImplementedError

    def data_received(self, data: bytes) -> None:
        # Frames sent while handling this chunk are flushed once at the end, in one write.
        was_flush_pending, self._is_flush_pending = self._is_flush_pending, True
        try:
            if self._read_buffer:
                self._read_buffer += data
                consumed = self._parse(self._read_buffer)
                del self._read_buffer[:consumed]
            else:
                consumed = self._parse(data)
                if consumed < len(data) and not self.is_closed:
                    self._read_buffer += data[consumed:]
        except Exception as exc:
            logger.exception("rpc: unexpected failure handling frames from %s", self.peer)
            self.close_with_reason(f"internal error handling a frame: {exc!r}")
        self._is_flush_pending = was_flush_pending
        if not was_flush_pending:
            self.flush()

    def _parse(self, data: bytes | bytearray) -> int:
        """Hand every complete frame in `data` to on_frame; returns the number of bytes consumed."""
        pos, end, limit = 0, len(data), self.max_frame_bytes
        with memoryview(data) as view:
            while end - pos >= HEADER_BYTES and not self.is_closed:
                (size,) = HEADER.unpack_from(data, pos)
                if size > limit:
                    self.close_with_reason(f"frame of {size} bytes exceeds the limit of {limit} bytes")
                    return end
                start = pos + HEADER_BYTES
                if end - start < size:
                    break
                try:
                    frame = msgpack.unpackb(view[start:start + size])
                except Exception as exc:
                    self.close_with_reason(f"malformed frame ({type(exc).__name__}: {exc})")
                    return end
                pos = start + size
                self.on_frame(frame)
        return pos

    def send_frame(self, frame: Any) -> None:
        """Queue one frame; ResourceExhausted if it exceeds max_frame_bytes (nothing is queued then)."""
        body = self._packer.pack(frame)
        if len(body) > self.max_frame_bytes:
            raise ResourceExhausted(
                f"a frame of {len(body)} bytes exceeds the limit of {self.max_frame_bytes} bytes"
            )
        if self.is_closed:
            return
        self._write_chunks.append(HEADER.pack(len(body)))
        self._write_chunks.append(body)
        if not self._is_flush_pending:
            self._is_flush_pending = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self._is_flush_pending = False
        if self._write_chunks and self.transport is not None and not self.is_closed:
            self.transport.write(b"".join(self._write_chunks))
        self._write_chunks.clear()

    def close_with_reason(self, reason: str, *, is_error: bool = True) -> None:
        """Flush what was queued (an error frame explaining the close, say), then close; logs the reason."""
        if self.is_closed:
            return
        logger.log(logging.WARNING if is_error else logging.DEBUG, "rpc: closing connection %s: %s", self.peer, reason)
        self.flush()
        self.is_closed = True
        if self.transport is not None:
            self.transport.close()
        self._wake_drain()

    def pause_writing(self) -> None:
        self._is_write_paused = True

    def resume_writing(self) -> None:
        self._is_write_paused = False
        self._wake_drain()

    async def drain(self) -> None:
        """Wait while the transport's write buffer is over its high-water mark (streams call this)."""
        if self._is_write_paused and not self.is_closed:
            self._drain_waiter = asyncio.get_running_loop().create_future()
            await self._drain_waiter

    def _wake_drain(self) -> None:
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_result(None)
        self._drain_waiter = None


class DeadlineWheel:
    """Deadlines of in-flight calls, in buckets of tick_s, served by one loop timer.

    Owned by one connection; keys are its call ids, which only increase, so a key is never reused. A finished
    call is `discard`ed (a dict pop and a set discard), and a bucket left empty goes with it, so the wheel holds
    only calls in flight, however long their deadlines (a decode stream's may be hours). The heap of bucket
    times drops buckets lazily and is rebuilt when most of it is stale. Expiry fires up to tick_s late.
    """

    def __init__(self, on_expire: Callable[[int], None], tick_s: float = 0.01) -> None:
        self._on_expire = on_expire
        self._tick_s = tick_s
        self._buckets: dict[int, set[int]] = {}
        self._bucket_of: dict[int, int] = {}  # key -> its bucket
        self._bucket_heap: list[int] = []  # every live bucket, and buckets emptied since (dropped when met)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_bucket = 0
        self._last_bucket = -1
        self._last_keys: set[int] = set()
        self._loop = asyncio.get_running_loop()
        self._time = self._loop.time

    def __len__(self) -> int:
        return len(self._bucket_of)

    def add(self, key: int, timeout_s: float) -> None:
        bucket = int((self._time() + timeout_s) / self._tick_s) + 1
        self._bucket_of[key] = bucket
        if bucket == self._last_bucket:  # calls with equal timeouts in a burst share a bucket
            self._last_keys.add(key)
            return
        keys = self._buckets.get(bucket)
        if keys is None:
            keys = self._buckets[bucket] = set()
            heapq.heappush(self._bucket_heap, bucket)
            if self._timer is None or bucket < self._timer_bucket:
                self._schedule(bucket)
        keys.add(key)
        self._last_bucket, self._last_keys = bucket, keys

    def discard(self, key: int) -> None:
        """`key`'s call finished: forget its deadline (a key not in the wheel is ignored)."""
        bucket = self._bucket_of.pop(key, None)
        if bucket is None:
            return
        keys = self._buckets[bucket]
        keys.discard(key)
        if keys:
            return
        del self._buckets[bucket]
        if bucket == self._last_bucket:
            self._last_bucket = -1
        if len(self._bucket_heap) > 2 * len(self._buckets) + 64:
            self._bucket_heap = list(self._buckets)
            heapq.heapify(self._bucket_heap)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._buckets.clear()
        self._bucket_of.clear()
        self._bucket_heap.clear()
        self._last_bucket = -1

    def _schedule(self, bucket: int) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_bucket = bucket
        self._timer = self._loop.call_at(bucket * self._tick_s, self._fire)

    def _fire(self) -> None:
        self._timer = None
        now_bucket = math.floor(self._loop.time() / self._tick_s)
        expired: list[int] = []
        while self._bucket_heap and self._bucket_heap[0] <= now_bucket:
            bucket = heapq.heappop(self._bucket_heap)
            keys = self._buckets.pop(bucket, ())
            for key in keys:
                del self._bucket_of[key]
            expired.extend(keys)
            if bucket == self._last_bucket:
                self._last_bucket = -1
        if self._bucket_heap:
            self._schedule(self._bucket_heap[0])
        for key in expired:
            self._on_expire(key)


def handshake_proof(secret: bytes, side: bytes, cluster_id: str, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """HMAC-SHA256 proving knowledge of the cluster secret; `side` (b"client"/b"server") stops reflection."""
    return auth.handshake_proof(secret, RPC_AUTH_LABEL, side, cluster_id, client_nonce, server_nonce)


def parse_address(address: str) -> tuple[str, str, int]:
    """("tcp", host, port) or ("unix", path, 0) from "tcp://host:port" or "unix:///path"."""
    if address.startswith("unix://"):
        path = address[len("unix://"):]
        if not path:
            raise ValueError(f"RPC address {address!r} has no socket path; write unix:///path/to/socket")
        return "unix", path, 0
    if address.startswith("tcp://"):
        host, sep, port = address[len("tcp://"):].rpartition(":")
        if sep and host and port.isdigit() and 0 < int(port) < 65536:
            return "tcp", host.strip("[]"), int(port)
    raise ValueError(f"RPC address {address!r} is not tcp://host:port or unix:///path")
