"""RPC server: accepts connections, authenticates them, runs calls through an explicit method table.

Lifecycle:
  1. add_method() fills the table; start_tcp() / start_unix() open listeners (several are allowed).
  2. Each connection (server_conn.ServerConnection) does the handshake and then carries many concurrent calls.
  3. stop(drain_timeout_s): close listeners and refuse new calls (Unavailable), wait for in-flight calls up
     to the deadline, cancel the rest, close every connection.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import stat
from typing import AsyncIterator, Awaitable, Callable

from mooncaked.rpc.frames import DEFAULT_MAX_FRAME_BYTES
from mooncaked.rpc.protocol import Method, ReqT, RespT
from mooncaked.rpc.server_conn import CallContext, MethodEntry, ServerConnection

logger = logging.getLogger(__name__)

_CANCEL_GRACE_S = 2.0


class RpcServer:
    """Owns its listeners, its method table, the set of live connections and every running call task."""

    def __init__(self, *, role: str, instance: str, cluster_id: str, secret: bytes | None,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, max_inflight_calls: int = 1024,
                 handshake_timeout_s: float = 5.0) -> None:
        if max_frame_bytes < 1024 or max_inflight_calls < 1 or handshake_timeout_s <= 0:
            raise ValueError("RpcServer: max_frame_bytes >= 1024, max_inflight_calls >= 1 and "
                             "handshake_timeout_s > 0 are required")
        self.role = role
        self.instance = instance
        self.cluster_id = cluster_id
        self.secret = secret or None
        self.max_frame_bytes = max_frame_bytes
        self.max_inflight_calls = max_inflight_calls
        self.handshake_timeout_s = handshake_timeout_s
        self.methods: dict[str, MethodEntry] = {}
        self.connections: set[ServerConnection] = set()
        self.call_tasks: set[asyncio.Task[None]] = set()
        self.is_stopping = False
        self._listeners: list[asyncio.AbstractServer] = []
        self._unix_paths: list[str] = []

    def add_method(self, method: Method[ReqT, RespT],
                   handler: Callable[[ReqT, CallContext], Awaitable[RespT]]
                   | Callable[[ReqT, CallContext], AsyncIterator[RespT]],
                   *, is_eager: bool = False) -> None:
        """Register a handler: unary `async def (req, ctx) -> resp`, streaming `async def` generator.

        is_eager (unary only) runs the handler inline until its first suspension, saving a Task per call
        (most of a cheap call's cost). Before that first await asyncio.current_task() is not the call's task,
        so eager handlers must not open asyncio.timeout() or a TaskGroup before awaiting something.
        """
        if method.name in self.methods:
            raise ValueError(f"method {method.name!r} is already registered")
        if method.is_streaming and not inspect.isasyncgenfunction(handler):
            raise TypeError(f"streaming method {method.name!r} needs an async generator handler")
        if not method.is_streaming and not inspect.iscoroutinefunction(handler):
            raise TypeError(f"unary method {method.name!r} needs an async def handler")
        if is_eager and method.is_streaming:
            raise ValueError(f"is_eager applies to unary methods, not to stream {method.name!r}")
        self.methods[method.name] = MethodEntry(method, handler, is_eager)

    @property
    def num_inflight_calls(self) -> int:
        """Calls whose handler is running (eager calls that finished inline are never counted)."""
        return len(self.call_tasks)

    async def start_tcp(self, host: str, port: int) -> int:
        """Listen on host:port (0 picks a free port); returns the bound port."""
        listener = await asyncio.get_running_loop().create_server(self._new_connection, host, port)
        self._listeners.append(listener)
        port = listener.sockets[0].getsockname()[1]
        logger.info("rpc: %s %s listening on tcp://%s:%d", self.role, self.instance, host, port)
        return int(port)

    async def start_unix(self, path: str) -> None:
        listener = await asyncio.get_running_loop().create_unix_server(self._new_connection, path)
        self._listeners.append(listener)
        self._unix_paths.append(path)
        logger.info("rpc: %s %s listening on unix://%s", self.role, self.instance, path)

    def _new_connection(self) -> asyncio.Protocol:
        return ServerConnection(self)

    async def stop(self, drain_timeout_s: float) -> None:
        """Stop accepting, drain in-flight calls up to drain_timeout_s, cancel the rest, close connections."""
        self.is_stopping = True
        for listener in self._listeners:
            listener.close()
        for conn in list(self.connections):
            if not conn.is_ready:
                conn.close_with_reason("server is stopping", is_error=False)
        if self.call_tasks:
            logger.info("rpc: draining %d in-flight call(s) for up to %.1fs", len(self.call_tasks), drain_timeout_s)
            await asyncio.wait(set(self.call_tasks), timeout=max(drain_timeout_s, 0.0))
        await self._cancel_calls()
        for conn in list(self.connections):
            conn.close_with_reason("server stopped", is_error=False)
        for listener in self._listeners:
            try:
                await asyncio.wait_for(listener.wait_closed(), _CANCEL_GRACE_S)
            except asyncio.TimeoutError:
                logger.warning("rpc: a listener of %s did not close within %.1fs", self.instance, _CANCEL_GRACE_S)
        self._listeners.clear()
        self._remove_unix_sockets()

    async def _cancel_calls(self) -> None:
        if not self.call_tasks:
            return
        logger.warning("rpc: cancelling %d call(s) still running after the drain", len(self.call_tasks))
        for task in self.call_tasks:
            task.cancel()
        _, pending = await asyncio.wait(set(self.call_tasks), timeout=_CANCEL_GRACE_S)
        if pending:
            logger.error("rpc: %d handler(s) ignored cancellation for %.1fs", len(pending), _CANCEL_GRACE_S)

    def _remove_unix_sockets(self) -> None:
        for path in self._unix_paths:
            try:
                if stat.S_ISSOCK(os.stat(path).st_mode):
                    os.unlink(path)
            except FileNotFoundError:
                pass
        self._unix_paths.clear()
