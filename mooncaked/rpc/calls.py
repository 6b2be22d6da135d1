"""What the server keeps per method and per call: the method table row, the call's context, what a connection
needs of its server (`ServerHost`), and the glue that lets an eager handler (run inline until its first
suspension) finish inside a Task."""

from __future__ import annotations

import asyncio
import inspect
import time
import types
from typing import Any, Callable, Coroutine, Generator, Protocol

from mooncaked.rpc.protocol import Method, array_decoder_for, array_encoder_for


class CallContext:
    """One call as its handler sees it; owned by the server connection running the call."""

    __slots__ = ("deadline", "peer_role", "peer_instance", "call_id", "method")

    def __init__(self, deadline: float, peer_role: str, peer_instance: str, call_id: int, method: str) -> None:
        self.deadline = deadline  # time.monotonic() based
        self.peer_role = peer_role
        self.peer_instance = peer_instance
        self.call_id = call_id
        self.method = method

    def time_left_s(self) -> float:
        return self.deadline - time.monotonic()

    def __repr__(self) -> str:
        return (f"CallContext(method={self.method!r}, call_id={self.call_id}, peer={self.peer_role}/"
                f"{self.peer_instance}, time_left_s={self.time_left_s():.3f})")


class MethodEntry:
    """A row of the server's method table, with the request decoder and reply encoder (array form) looked up
    once."""

    __slots__ = ("method", "handler", "is_eager", "decode_request", "encode_reply", "reply_type")

    def __init__(self, method: Method[Any, Any], handler: Callable[[Any, CallContext], Any], is_eager: bool) -> None:
        self.method = method
        self.handler = handler
        self.is_eager = is_eager
        self.decode_request = array_decoder_for(method.request)
        self.encode_reply = array_encoder_for(method.response)
        self.reply_type = method.response


class ServerHost(Protocol):
    """What a server connection reads of its server (the RpcServer), and the two sets it adds itself to."""

    role: str
    instance: str
    cluster_id: str
    secret: bytes | None
    max_frame_bytes: int
    max_inflight_calls: int
    handshake_timeout_s: float
    methods: dict[str, MethodEntry]
    connections: set[Any]  # the live ServerConnections
    call_tasks: set[asyncio.Task[None]]
    is_stopping: bool


@types.coroutine
def resume(coro: Coroutine[Any, Any, Any], suspended_on: Any) -> Generator[Any, Any, Any]:
    """Continue, inside a Task, a coroutine whose first step ran outside any task (the eager path).

    Re-yields what the coroutine suspended on, so the Task waits for it, then relays sends and throws.
    """
    while True:
        try:
            value = yield suspended_on
        except GeneratorExit:
            coro.close()
            raise
        except BaseException as exc:
            try:
                suspended_on = coro.throw(exc)
            except StopIteration as stop:
                return stop.value
        else:
            try:
                suspended_on = coro.send(value)
            except StopIteration as stop:
                return stop.value


def cancel_unresumed(coro: Coroutine[Any, Any, Any]) -> None:
    """A call task cancelled before its first step never resumed its eager handler: cancel the handler now."""
    if inspect.getcoroutinestate(coro) != inspect.CORO_SUSPENDED:
        return
    try:
        coro.throw(asyncio.CancelledError())
    except BaseException:
        return
    coro.close()
