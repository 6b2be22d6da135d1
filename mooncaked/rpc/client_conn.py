"""One RPC connection on the client side.

Lifecycle:
  1. handshake(): Hello -> Challenge (checked: protocol version, and the server's HMAC proof when this client
     has a secret) -> Auth -> Welcome; any error frame raises its RpcError (Unauthenticated, ...).
  2. call() / start_stream(): each call gets an id, a waiter and a deadline in the DeadlineWheel; replies are
     matched by id. A caller that gives up (task cancelled, stream closed early, deadline) sends a cancel frame.
  3. connection_lost fails every pending call with Unavailable; the pool (client.py) opens a new connection.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import logging
import os
from dataclasses import dataclass
from typing import Any

from mooncaked.rpc.errors import DeadlineExceeded, Internal, RpcError, Unauthenticated, Unavailable, error_from_wire
from mooncaked.rpc.frames import HANDSHAKE_MAX_FRAME_BYTES, NONCE_BYTES, DeadlineWheel, FramedProtocol, handshake_proof
from mooncaked.rpc.protocol import (PROTOCOL_VERSION, Auth, CallFrame, CancelFrame, Challenge, EndFrame, ErrorFrame,
                                    Frame, Hello, ItemFrame, Method, ProtocolError, ReqT, RespT, ResultFrame, Welcome,
                                    decode_frame, encode_frame)

logger = logging.getLogger(__name__)

_CALL, _RESULT, _ERROR, _ITEM, _END, _CANCEL = (CallFrame.TAG, ResultFrame.TAG, ErrorFrame.TAG, ItemFrame.TAG,
                                                EndFrame.TAG, CancelFrame.TAG)


@dataclass(frozen=True)
class ClientIdentity:
    """Who this client is, as told in the handshake."""

    address: str
    role: str
    instance: str
    cluster_id: str
    secret: bytes | None


class StreamState:
    """Items received for one stream call and not yet consumed; owned by the ClientConnection."""

    __slots__ = ("call_id", "items", "waiter", "is_ended", "error")

    def __init__(self, call_id: int) -> None:
        self.call_id = call_id
        self.items: collections.deque[Any] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None
        self.is_ended = False
        self.error: RpcError | None = None

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class ClientConnection(FramedProtocol):
    """Owns one client connection: its pending calls and streams by id and their deadlines."""

    def __init__(self, identity: ClientIdentity, max_frame_bytes: int) -> None:
        super().__init__(HANDSHAKE_MAX_FRAME_BYTES)
        self.identity = identity
        self.is_ready = False
        self._own_max_frame_bytes = max_frame_bytes
        self._next_call_id = 1
        self._pending: dict[int, Any] = {}  # call id -> Future of the reply frame, or StreamState
        self._handshake_frames: collections.deque[Any] = collections.deque()
        self._handshake_waiter: asyncio.Future[None] | None = None
        self._loop = asyncio.get_running_loop()
        self._deadlines = DeadlineWheel(self._on_deadline)

    # --- handshake ----------------------------------------------------------------------------

    async def handshake(self) -> None:
        identity, client_nonce = self.identity, os.urandom(NONCE_BYTES)
        self.send_frame(encode_frame(Hello(PROTOCOL_VERSION, identity.role, identity.instance, identity.cluster_id,
                                           client_nonce)))
        challenge = await self._next_handshake_frame(Challenge)
        proof = b""
        if identity.secret is not None:
            if not challenge.server_proof:
                raise Unauthenticated(f"{identity.address} does not authenticate; configure the cluster secret "
                                      "on the server too")
            expected = handshake_proof(identity.secret, b"server", identity.cluster_id, client_nonce,
                                       challenge.server_nonce)
            if not hmac.compare_digest(challenge.server_proof, expected):
                raise Unauthenticated(f"{identity.address} failed to prove the cluster secret")
            proof = handshake_proof(identity.secret, b"client", identity.cluster_id, client_nonce,
                                    challenge.server_nonce)
        self.send_frame(encode_frame(Auth(proof)))
        welcome = await self._next_handshake_frame(Welcome)
        self.max_frame_bytes = min(self._own_max_frame_bytes, welcome.max_frame_bytes)
        self.is_ready = True

    async def _next_handshake_frame(self, cls: type[Frame]) -> Any:
        while not self._handshake_frames:
            if self.is_closed:
                raise Unavailable(f"{self.identity.address} closed the connection during the handshake")
            self._handshake_waiter = self._loop.create_future()
            await self._handshake_waiter
        try:
            frame = decode_frame(self._handshake_frames.popleft())
        except ProtocolError as exc:
            raise Internal(f"bad handshake frame from {self.identity.address}: {exc}") from None
        if type(frame) is ErrorFrame:
            raise error_from_wire(frame.code, frame.message)
        if type(frame) is not cls:
            raise Internal(f"{self.identity.address} sent {frame.TYPE!r} during the handshake, expected {cls.TYPE!r}")
        return frame

    def _wake_handshake(self) -> None:
        if self._handshake_waiter is not None and not self._handshake_waiter.done():
            self._handshake_waiter.set_result(None)

    # --- frames in ----------------------------------------------------------------------------

    def on_frame(self, frame: Any) -> None:
        """The hot path: a reply (result or error) wakes its caller, which decodes or raises it."""
        if type(frame) is not list or len(frame) < 2 or type(frame[1]) is not int or not self.is_ready:
            self._on_other_frame(frame)
            return
        tag = frame[0]
        if (tag == _RESULT and len(frame) == 3) or (tag == _ERROR and len(frame) == 4):
            waiter = self._pending.pop(frame[1], None)
            self._deadlines.discard(frame[1])
            if type(waiter) is StreamState:
                waiter.error = error_from_wire(frame[2], frame[3]) if tag == _ERROR else Internal(
                    "result frame for a stream")
                waiter.wake()
            elif waiter is not None and not waiter.done():  # None: the caller gave up already
                waiter.set_result(frame)
        elif tag == _ITEM and len(frame) == 3:
            self._on_item(frame)
        elif tag == _END and len(frame) == 2:
            self._on_end(frame)
        else:
            self.close_with_reason(f"unexpected frame from the server (array tagged {tag!r})")

    def _on_other_frame(self, frame: Any) -> None:
        if not self.is_ready:
            self._handshake_frames.append(frame)
            self._wake_handshake()
        else:
            self.close_with_reason("unexpected frame from the server (expected an array [tag, int id, ...])")

    def _on_item(self, frame: list[Any]) -> None:
        state = self._pending.get(frame[1])
        if type(state) is StreamState:
            state.items.append(frame[2])
            state.wake()
        elif state is not None:
            self.close_with_reason(f"stream item for unary call {frame[1]}")

    def _on_end(self, frame: list[Any]) -> None:
        state = self._pending.get(frame[1])
        if type(state) is StreamState:
            del self._pending[frame[1]]
            self._deadlines.discard(frame[1])
            state.is_ended = True
            state.wake()

    def _on_deadline(self, call_id: int) -> None:
        waiter = self._pending.pop(call_id, None)
        if waiter is None:
            return
        error = DeadlineExceeded(f"call {call_id} to {self.identity.address} passed its deadline")
        if type(waiter) is StreamState:
            waiter.error = error
            waiter.wake()
        elif not waiter.done():
            waiter.set_exception(error)
        self._send_cancel(call_id)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._deadlines.close()
        self._wake_handshake()
        pending, self._pending = self._pending, {}
        for waiter in pending.values():
            error = Unavailable(f"connection to {self.identity.address} lost" + (f": {exc}" if exc else ""))
            if type(waiter) is StreamState:
                waiter.error = error
                waiter.wake()
            elif not waiter.done():
                waiter.set_exception(error)

    # --- calls out ----------------------------------------------------------------------------

    def _start_call(self, method: Method[Any, Any], request: Any, timeout_s: float, waiter: Any) -> int:
        if self.is_closed:
            raise Unavailable(f"connection to {self.identity.address} is closed")
        call_id = self._next_call_id
        self._next_call_id += 1
        self.send_frame([_CALL, call_id, method.name, method.encode_request(request), timeout_s])
        self._pending[call_id] = waiter
        self._deadlines.add(call_id, timeout_s)
        return call_id

    async def call(self, method: Method[ReqT, RespT], request: ReqT, timeout_s: float) -> RespT:
        # _start_call inlined: this is the hot path of every unary call.
        if self.is_closed:
            raise Unavailable(f"connection to {self.identity.address} is closed")
        call_id = self._next_call_id
        self._next_call_id = call_id + 1
        self.send_frame([_CALL, call_id, method.name, method.encode_request(request), timeout_s])
        waiter: asyncio.Future[list[Any]] = self._loop.create_future()
        self._pending[call_id] = waiter
        self._deadlines.add(call_id, timeout_s)
        try:
            frame = await waiter
        except asyncio.CancelledError:
            self._deadlines.discard(call_id)
            if self._pending.pop(call_id, None) is not None:
                self._send_cancel(call_id)
            raise
        if frame[0] != _RESULT:
            raise error_from_wire(frame[2], frame[3])
        try:
            return method.decode_response(frame[2])
        except ValueError as exc:  # ProtocolError, or the message's own __post_init__ validation
            raise Internal(f"{method.name}: bad reply from {self.identity.address}: {exc}") from None

    def start_stream(self, method: Method[Any, Any], request: Any, timeout_s: float) -> StreamState:
        state = StreamState(0)
        state.call_id = self._start_call(method, request, timeout_s, state)
        return state

    async def next_item(self, state: StreamState) -> Any:
        """The next item's payload, None at the end of the stream; raises the stream's error."""
        while not state.items:
            if state.error is not None:
                raise state.error
            if state.is_ended:
                return None
            state.waiter = self._loop.create_future()
            try:
                await state.waiter
            finally:
                state.waiter = None
        return state.items.popleft()

    def finish_stream(self, state: StreamState) -> None:
        """The consumer is done: forget the call, and cancel it on the server if it still runs."""
        self._deadlines.discard(state.call_id)
        if self._pending.pop(state.call_id, None) is not None:
            self._send_cancel(state.call_id)

    def _send_cancel(self, call_id: int) -> None:
        self.send_frame([_CANCEL, call_id])
