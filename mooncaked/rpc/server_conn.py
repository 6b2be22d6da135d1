"""One accepted RPC connection on the server side.

Lifecycle:
  1. Handshake (server_handshake.py), with frames of at most HANDSHAKE_MAX_FRAME_BYTES and a deadline: Hello
     (protocol version, role, instance, cluster id, client nonce) -> Challenge (server nonce, and the server's
     HMAC proof when a secret is configured) -> Auth (the client's proof) -> Welcome. A failure sends an error
     frame (id 0) and closes the connection.
  2. Calls: each call frame is checked, its request decoded, and its handler run: eager handlers inline until
     their first suspension (a reply queued at once when they finish there), the others (and streams) in one
     Task per call with a deadline and an entry in `tasks` so a cancel frame, the deadline or the server's
     stop can cancel it.
  3. connection_lost cancels every call still running for this connection.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any, AsyncGenerator, Coroutine

from mooncaked.rpc.calls import CallContext, MethodEntry, ServerHost, cancel_unresumed, resume
from mooncaked.rpc.errors import (Cancelled, DeadlineExceeded, Internal, InvalidArgument, NotFound, ResourceExhausted,
                                  RpcError, Unavailable)
from mooncaked.rpc.frames import HANDSHAKE_MAX_FRAME_BYTES, HEADER, MAX_TIMEOUT_S, DeadlineWheel, FramedProtocol
from mooncaked.rpc.protocol import (CallFrame, CancelFrame, Challenge, EndFrame, ErrorFrame, ItemFrame, ResultFrame,
                                    encode_frame)
from mooncaked.rpc.server_handshake import ServerHandshake

logger = logging.getLogger(__name__)

_MAX_ERROR_MESSAGE_CHARS = 2000
_NUMBER_TYPES = (float, int)
_CALL, _RESULT, _ERROR, _ITEM, _END, _CANCEL = (CallFrame.TAG, ResultFrame.TAG, ErrorFrame.TAG, ItemFrame.TAG,
                                                EndFrame.TAG, CancelFrame.TAG)


class ServerConnection(FramedProtocol):
    """Owns one accepted connection: its handshake (ServerHandshake), its running call tasks and their deadlines."""

    def __init__(self, server: ServerHost) -> None:
        super().__init__(HANDSHAKE_MAX_FRAME_BYTES)
        self.server = server
        self.is_ready = False
        self.peer_role = ""
        self.peer_instance = ""
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self._last_call_id = 0  # call ids increase on a connection, so the DeadlineWheel never sees one twice
        self._expired_ids: set[int] = set()
        self._handshake = ServerHandshake(server)
        self._deadlines: DeadlineWheel | None = None
        self._handshake_timer: asyncio.TimerHandle | None = None
        self._received_at = 0.0
        self._methods = server.methods
        self._max_inflight_calls = server.max_inflight_calls

    # --- connection lifecycle -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self.server.is_stopping:
            self.close_with_reason("server is stopping", is_error=False)
            return
        self.server.connections.add(self)
        loop = asyncio.get_running_loop()
        self._deadlines = DeadlineWheel(self._on_deadline)
        self._handshake_timer = loop.call_later(self.server.handshake_timeout_s, self._on_handshake_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.server.connections.discard(self)
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
        if self._deadlines is not None:
            self._deadlines.close()
        for task in self.tasks.values():
            task.cancel()

    def _on_handshake_timeout(self) -> None:
        if not self.is_ready:
            self.close_with_reason(f"no handshake within {self.server.handshake_timeout_s}s")

    # --- handshake ----------------------------------------------------------------------------

    def _on_handshake_frame(self, frame: Any) -> None:
        try:
            reply = self._handshake.step(frame)
        except RpcError as error:
            self.send_frame(encode_frame(ErrorFrame(0, error.code, error.message)))
            self.close_with_reason(f"handshake refused: {error}")
            return
        if type(reply) is Challenge:
            self.peer_role, self.peer_instance = self._handshake.peer_role, self._handshake.peer_instance
            self.send_frame(encode_frame(reply))
            return
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
        self.is_ready = True
        self.max_frame_bytes = self.server.max_frame_bytes
        self.send_frame(encode_frame(reply))
        logger.debug("rpc: %s accepted %s %s from %s", self.server.instance, self.peer_role, self.peer_instance,
                     self.peer)

    # --- calls --------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        # One clock read per chunk: every call in it arrived at the same moment.
        self._received_at = time.monotonic()
        super().data_received(data)

    def on_frame(self, frame: Any) -> None:
        """The hot path, fused so that a call costs no frame dataclass and few calls: check the call frame,
        decode the request, run the handler (eagerly, inline) and queue its reply."""
        if type(frame) is not list or len(frame) != 5 or frame[0] != _CALL or not self.is_ready:
            self._on_other_frame(frame)
            return
        _, call_id, name, args, timeout_s = frame
        if (type(call_id) is not int or type(name) is not str or type(timeout_s) not in _NUMBER_TYPES
                or call_id <= self._last_call_id):
            self._close_bad_call(call_id)
            return
        self._last_call_id = call_id
        entry = self._methods.get(name)
        if entry is None or not 0 < timeout_s <= MAX_TIMEOUT_S or len(self.tasks) >= self._max_inflight_calls \
                or self.server.is_stopping:
            self._refuse_call(call_id, name, entry, timeout_s)
            return
        try:
            request = entry.decode_request(args)
        except ValueError as exc:  # ProtocolError, or a message's own __post_init__ validation
            self.send_error(call_id, InvalidArgument(f"{name}: {exc}"))
            return
        ctx = CallContext(self._received_at + timeout_s, self.peer_role, self.peer_instance, call_id, name)
        if not entry.is_eager:
            coro = self._run_stream(entry, request, ctx) if entry.method.is_streaming else \
                self._run_unary(entry, request, ctx, None)
            self._start_task(coro, ctx, timeout_s)
            return
        handler_coro = entry.handler(request, ctx)
        try:
            suspended_on = handler_coro.send(None)
        except StopIteration as stop:
            result = stop.value
        except asyncio.CancelledError:
            self.send_error(call_id, Cancelled(f"{name} cancelled itself"))
            return
        except Exception as exc:
            self._send_handler_error(entry, call_id, exc)
            return
        else:
            self._start_task(self._run_unary(entry, request, ctx, (handler_coro, suspended_on)), ctx, timeout_s,
                             handler_coro)
            return
        # send_frame inlined: on_frame runs inside data_received, which flushes when it is done.
        try:
            body = self._packer.pack([_RESULT, call_id, entry.encode_reply(result)]) \
                if type(result) is entry.reply_type else None
        except Exception:
            body = None
        if body is not None and len(body) <= self.max_frame_bytes and not self.is_closed:
            self._write_chunks += (HEADER.pack(len(body)), body)
            return
        self._send_result(entry, call_id, result)  # sends the error that says what is wrong with the reply

    def _on_other_frame(self, frame: Any) -> None:
        if not self.is_ready:
            self._on_handshake_frame(frame)
        elif type(frame) is list and len(frame) == 2 and frame[0] == _CANCEL and type(frame[1]) is int:
            task = self.tasks.get(frame[1])
            if task is not None:
                task.cancel()
        elif type(frame) is list and len(frame) == 5 and frame[0] == _CALL:
            self._close_bad_call(frame[1])
        else:
            self.close_with_reason(f"unexpected frame on a ready connection: {_describe(frame)}")

    def _close_bad_call(self, call_id: Any) -> None:
        if type(call_id) is int and call_id <= self._last_call_id:
            self.close_with_reason(f"call id {call_id} is not above the previous {self._last_call_id}")
        else:
            self.close_with_reason("malformed call frame: expected [tag, int id, str method, args, "
                                   "number timeout_s]")

    def _refuse_call(self, call_id: int, name: str, entry: MethodEntry | None, timeout_s: float) -> None:
        server = self.server
        if entry is None:
            self.send_error(call_id, NotFound(f"no method {name!r} on {server.role} {server.instance}"))
            self.close_with_reason(f"unknown method {name!r}")
        elif server.is_stopping:
            self.send_error(call_id, Unavailable(f"{server.role} {server.instance} is stopping"))
        elif len(self.tasks) >= self._max_inflight_calls:
            self.send_error(call_id, ResourceExhausted(
                f"{server.max_inflight_calls} calls already in flight on this connection; retry later"))
        elif not timeout_s <= 0:  # NaN, inf or past MAX_TIMEOUT_S
            self.send_error(call_id, InvalidArgument(f"{name}: timeout_s {timeout_s!r} is not a finite number of "
                                                     f"seconds <= {MAX_TIMEOUT_S:.0f}"))
        else:
            self.send_error(call_id, DeadlineExceeded(f"{name}: call arrived with no time left"))

    def _on_deadline(self, call_id: int) -> None:
        task = self.tasks.get(call_id)
        if task is not None:
            self._expired_ids.add(call_id)
            task.cancel()

    def _start_task(self, coro: Coroutine[Any, Any, None], ctx: CallContext, timeout_s: float,
                    unresumed: Coroutine[Any, Any, Any] | None = None) -> None:
        assert self._deadlines is not None
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks[ctx.call_id] = task
        self._deadlines.add(ctx.call_id, timeout_s)
        self.server.call_tasks.add(task)
        task.add_done_callback(functools.partial(self._on_task_done, ctx, unresumed))

    def _on_task_done(self, ctx: CallContext, unresumed: Coroutine[Any, Any, Any] | None,
                      task: asyncio.Task[None]) -> None:
        """Bookkeeping here rather than in the coroutine: a task cancelled before its first step runs no code."""
        self.server.call_tasks.discard(task)
        del self.tasks[ctx.call_id]
        if self._deadlines is not None:
            self._deadlines.discard(ctx.call_id)
        if unresumed is not None:
            cancel_unresumed(unresumed)
        if task.cancelled():
            self._send_cancelled(ctx)

    async def _run_unary(self, entry: MethodEntry, request: Any, ctx: CallContext,
                         suspended: tuple[Coroutine[Any, Any, Any], Any] | None) -> None:
        """Run (or, for an eager handler, resume) a unary handler; CancelledError goes to _on_task_done."""
        try:
            if suspended is None:
                result = await entry.handler(request, ctx)
            else:
                result = await resume(*suspended)
        except Exception as exc:
            self._send_handler_error(entry, ctx.call_id, exc)
            return
        self._send_result(entry, ctx.call_id, result)

    async def _run_stream(self, entry: MethodEntry, request: Any, ctx: CallContext) -> None:
        items: AsyncGenerator[Any, None] = entry.handler(request, ctx)
        try:
            async for item in items:
                self._send_item(entry, ctx.call_id, item)
                await self.drain()
            self.send_frame([_END, ctx.call_id])
        except Exception as exc:
            self._send_handler_error(entry, ctx.call_id, exc)
        finally:
            await items.aclose()

    # --- replies ------------------------------------------------------------------------------

    def _send_result(self, entry: MethodEntry, call_id: int, result: Any) -> None:
        if type(result) is not entry.reply_type:
            self._send_handler_error(entry, call_id, TypeError(
                f"handler returned {type(result).__name__}, expected {entry.reply_type.__name__}"))
            return
        try:
            self.send_frame([_RESULT, call_id, entry.encode_reply(result)])
        except Exception as exc:
            self._send_handler_error(entry, call_id, exc)

    def _send_item(self, entry: MethodEntry, call_id: int, item: Any) -> None:
        if type(item) is not entry.reply_type:
            raise TypeError(f"stream yielded {type(item).__name__}, expected {entry.reply_type.__name__}")
        self.send_frame([_ITEM, call_id, entry.encode_reply(item)])

    def _send_cancelled(self, ctx: CallContext) -> None:
        """A cancelled handler: say why unless the client itself cancelled (it no longer waits)."""
        if ctx.call_id in self._expired_ids:
            self._expired_ids.discard(ctx.call_id)
            self.send_error(ctx.call_id, DeadlineExceeded(f"{ctx.method} passed its deadline"))
        elif self.server.is_stopping:
            self.send_error(ctx.call_id, Unavailable(f"{self.server.instance} stopped before {ctx.method} finished"))

    def _send_handler_error(self, entry: MethodEntry, call_id: int, exc: Exception) -> None:
        if isinstance(exc, RpcError):
            self.send_error(call_id, exc)
            return
        name = entry.method.name
        logger.error("rpc: %s call %d from %s %s failed: %s", name, call_id, self.peer_role, self.peer_instance,
                     exc, exc_info=exc)
        self.send_error(call_id, Internal(f"{name} failed on {self.server.role} {self.server.instance} "
                                          f"({type(exc).__name__}); see its log"))

    def send_error(self, call_id: int, error: RpcError) -> None:
        message = error.message[:_MAX_ERROR_MESSAGE_CHARS]
        self.send_frame([_ERROR, call_id, error.code, message])


def _describe(frame: Any) -> str:
    if type(frame) is list:
        return f"array tagged {frame[0]!r}" if frame else "empty array"
    if type(frame) is dict:
        return f"map of type {frame.get('t')!r}"
    return f"a {type(frame).__name__}"
