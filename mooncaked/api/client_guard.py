"""Slow and greedy HTTP clients: a deadline on each request's headers and body, a cap on connections per address.

1. `GuardedSite` listens like aiohttp's TCPSite but wraps every accepted connection's protocol in a `_Guarded`
   one. A connection from an address that already holds `max_connections_per_client` gets a 429 in OpenAI's
   error JSON and is closed before anything is read.
2. While a connection is idle, its first byte starts the request's clock: the request's headers must be complete
   (the app's `middleware` sees the request) within `client_timeout_s`, or the connection is closed.
3. Handlers read the body with `read_body`, which gives up at the same deadline: a 408, written at once, and the
   connection closes (aiohttp would otherwise linger, reading the rest of the body). A body read as a stream (an
   upload) goes through `read_step` instead: each step (the next part, the next chunk) must arrive within
   `client_timeout_s` of the previous one, so a large upload may take long but never stall.
4. When the response is done the connection is idle again; bytes that arrived meanwhile (a pipelined request)
   start the next clock at once.
Each cut-off and refusal is logged with the client's address, at most once per address and reason every
LOG_INTERVAL_S (with the number left unlogged), so a flood of slow clients cannot flood the log; an address not
logged for LOG_INTERVAL_S is forgotten (its unlogged count, if any, logged then), so the bookkeeping holds only
recent addresses however many clients come and go.

Owner: the conductor role owns one ClientGuard; the guard owns the per-connection states (by transport).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from aiohttp import web

from mooncaked.api.errors import ApiError

logger = logging.getLogger(__name__)

LOG_INTERVAL_S = 10.0
CLOSE_LINGER_S = 1.0
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
T = TypeVar("T")


@dataclass
class _Connection:
    """One accepted connection's state (owned by the guard)."""

    address: str
    protocol: _Guarded
    request_started_at: float | None = None  # loop time of the current request's first byte
    is_in_handler: bool = False
    has_bytes_in_handler: bool = False
    is_cut_off: bool = False  # its body came too late: close once the 408 is written
    timer: asyncio.TimerHandle | None = None


class ClientGuard:
    """See the module docstring."""

    def __init__(self, *, client_timeout_s: float, max_connections_per_client: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not client_timeout_s > 0 or max_connections_per_client < 1:
            raise ValueError("client_timeout_s must be > 0 and max_connections_per_client >= 1")
        self.client_timeout_s = client_timeout_s
        self.max_connections_per_client = max_connections_per_client
        self.num_open: Counter[str] = Counter()
        self.num_cut_off = 0
        self.num_refused = 0
        self._connections: dict[asyncio.BaseTransport, _Connection] = {}
        self._clock = clock
        self._last_logged: dict[tuple[str, str], float] = {}
        self._num_unlogged: Counter[tuple[str, str]] = Counter()
        self._last_swept = clock()

    def wrap(self, inner: asyncio.Protocol) -> asyncio.Protocol:
        return _Guarded(self, inner)

    # ---- the app's side -----------------------------------------------------------------------------------
    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        connection = self._connections.get(request.transport) if request.transport is not None else None
        if connection is None:
            return await handler(request)
        self._stop_clock(connection)
        connection.is_in_handler, connection.has_bytes_in_handler = True, False
        try:
            response = await handler(request)
            if connection.is_cut_off:  # write the 408 now and close: aiohttp would linger reading the body
                await response.prepare(request)
                await response.write_eof()
                connection.protocol.close_after_reply()
            return response
        finally:
            connection.is_in_handler = False
            connection.request_started_at = None
            if connection.has_bytes_in_handler:
                self._start_clock(connection)

    async def read_body(self, request: web.Request) -> bytes:
        """The request body, or a 408 (the connection closes) once the request's deadline has passed."""
        connection = self._connections.get(request.transport) if request.transport is not None else None
        started_at = connection.request_started_at if connection is not None else None
        if started_at is None:  # a request the guard's protocol did not clock: its clock starts now
            started_at = asyncio.get_running_loop().time()
        try:
            async with asyncio.timeout_at(started_at + self.client_timeout_s):
                return await request.read()
        except TimeoutError:
            raise self._cut_off(connection, "did not arrive within") from None

    async def read_step(self, request: web.Request, step: Awaitable[T]) -> T:
        """One step of a body read as a stream; a 408 (the connection closes) when it takes over client_timeout_s."""
        try:
            async with asyncio.timeout(self.client_timeout_s):
                return await step
        except TimeoutError:
            connection = self._connections.get(request.transport) if request.transport is not None else None
            raise self._cut_off(connection, "made no progress for") from None

    def _cut_off(self, connection: _Connection | None, how: str) -> ApiError:
        address = connection.address if connection is not None else "a client"
        if connection is not None:
            connection.is_cut_off = True
        self.num_cut_off += 1
        self._log(address, "body", "conductor: cut off %s: its request body %s conductor.client_timeout_s (%.1f s)",
                  address, how, self.client_timeout_s)
        return ApiError(408, f"The request body {how} {self.client_timeout_s:g} s; send it faster.",
                        code="request_timeout")

    # ---- the connection's side ----------------------------------------------------------------------------
    def _admit(self, connection: _Connection, transport: asyncio.BaseTransport) -> bool:
        if self.num_open[connection.address] >= self.max_connections_per_client:
            self.num_refused += 1
            self._log(connection.address, "limit", "conductor: refused a connection from %s: it already holds %d "
                      "(conductor.max_connections_per_client)", connection.address, self.max_connections_per_client)
            return False
        self.num_open[connection.address] += 1
        self._connections[transport] = connection
        return True

    def _on_bytes(self, connection: _Connection) -> None:
        if connection.is_in_handler:
            connection.has_bytes_in_handler = True
        elif connection.request_started_at is None:
            self._start_clock(connection)

    def _release(self, connection: _Connection, transport: asyncio.BaseTransport) -> None:
        self._stop_clock(connection)
        if self._connections.pop(transport, None) is not None:
            self.num_open[connection.address] -= 1
            if not self.num_open[connection.address]:
                del self.num_open[connection.address]

    def _start_clock(self, connection: _Connection) -> None:
        loop = asyncio.get_running_loop()
        connection.request_started_at = loop.time()
        connection.timer = loop.call_later(self.client_timeout_s, self._on_headers_late, connection)

    def _stop_clock(self, connection: _Connection) -> None:
        if connection.timer is not None:
            connection.timer.cancel()
            connection.timer = None

    def _on_headers_late(self, connection: _Connection) -> None:
        connection.timer = None
        self.num_cut_off += 1
        self._log(connection.address, "headers", "conductor: cut off %s: its request headers did not arrive within "
                  "conductor.client_timeout_s (%.1f s)", connection.address, self.client_timeout_s)
        connection.protocol.abort()

    def _log(self, address: str, reason: str, message: str, *args: Any) -> None:
        now, key = self._clock(), (address, reason)
        self._forget_quiet_addresses(now)
        if now - self._last_logged.get(key, -LOG_INTERVAL_S) < LOG_INTERVAL_S:
            self._num_unlogged[key] += 1
            return
        self._last_logged[key] = now
        unlogged = self._num_unlogged.pop(key, 0)
        suffix = f" ({unlogged} more like it in the last {LOG_INTERVAL_S:g} s)" if unlogged else ""
        logger.warning(message + suffix, *args)

    def _forget_quiet_addresses(self, now: float) -> None:
        """Once per LOG_INTERVAL_S: drop addresses logged longer ago than that, reporting what they left unlogged."""
        if now - self._last_swept < LOG_INTERVAL_S:
            return
        self._last_swept = now
        for key in [key for key, logged_at in self._last_logged.items() if now - logged_at >= LOG_INTERVAL_S]:
            del self._last_logged[key]
            num_unlogged = self._num_unlogged.pop(key, 0)
            if num_unlogged:
                logger.warning("conductor: %d more cut-offs or refusals (%s) of %s were not logged", num_unlogged,
                               key[1], key[0])


class _Guarded(asyncio.Protocol):
    """An aiohttp request handler (`inner`) behind the guard's checks; forwards every protocol call until the
    connection is refused or cut off, then discards what the client still sends until it closes."""

    def __init__(self, guard: ClientGuard, inner: asyncio.Protocol) -> None:
        self._guard = guard
        self._inner = inner
        self._transport: asyncio.Transport | None = None
        self._connection: _Connection | None = None
        self._is_closing = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = writable = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it
        peer = transport.get_extra_info("peername")
        connection = _Connection(str(peer[0]) if peer else "?", self)
        if not self._guard._admit(connection, transport):
            writable.write(_too_many_connections(self._guard.max_connections_per_client))
            self.close_after_reply()
            return
        self._connection = connection
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._connection is None or self._is_closing:
            return
        self._guard._on_bytes(self._connection)
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self._is_closing or self._connection is None:
            return False  # the transport closes itself
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._connection is None:
            return
        assert self._transport is not None
        self._guard._release(self._connection, self._transport)
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._connection is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._connection is not None:
            self._inner.resume_writing()

    def close_after_reply(self) -> None:
        """Send what is written, shut our side, and drop what still comes in until the client closes or
        CLOSE_LINGER_S pass: closing with unread bytes would reset the connection and lose the reply."""
        transport = self._transport
        if transport is None or self._is_closing:
            return
        self._is_closing = True
        if transport.can_write_eof():
            transport.write_eof()
        asyncio.get_running_loop().call_later(CLOSE_LINGER_S, transport.close)

    def abort(self) -> None:
        if self._transport is not None:
            self._is_closing = True
            self._transport.close()


def _too_many_connections(limit: int) -> bytes:
    error = ApiError(429, f"This address already holds {limit} open connections; close some or reuse them.",
                     code="too_many_connections", retry_after_s=1.0)
    body = json.dumps(error.to_json()).encode()
    head = (f"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Retry-After: 1\r\nConnection: close\r\n\r\n")
    return head.encode() + body


class GuardedSite(web.BaseSite):
    """aiohttp's TCP site with every connection behind a ClientGuard."""

    __slots__ = ("_host", "_port", "_guard")

    def __init__(self, runner: web.BaseRunner, host: str, port: int, guard: ClientGuard, *,
                 backlog: int = 128) -> None:
        super().__init__(runner, backlog=backlog)
        self._host = host
        self._port = port
        self._guard = guard

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            lambda: self._guard.wrap(server()), self._host, self._port, backlog=self._backlog)
