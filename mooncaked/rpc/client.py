"""RPC client: a pool of connections to one address, used round-robin, reconnecting with backoff.

Lifecycle:
  1. RpcClient(address, ...) opens nothing; the first call on each pool slot connects it.
  2. call() / stream() pick the next slot; a slot whose connection is missing or closed reconnects with
     exponential backoff (jittered) for up to connect_timeout_s, shared by every caller waiting on that slot.
     A call never waits longer than its own timeout_s, connecting included.
  3. close(): cancels connection attempts and closes every connection (pending calls fail with Unavailable).
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any, AsyncGenerator, Coroutine

from mooncaked.rpc.client_conn import ClientConnection, ClientIdentity
from mooncaked.rpc.errors import DeadlineExceeded, Unavailable
from mooncaked.rpc.frames import DEFAULT_MAX_FRAME_BYTES, check_timeout, parse_address
from mooncaked.rpc.protocol import Method, ReqT, RespT

logger = logging.getLogger(__name__)


class RpcClient:
    """Owns pool_size connection slots to one server address and the tasks that (re)connect them."""

    def __init__(self, address: str, *, role: str, instance: str, cluster_id: str, secret: bytes | None,
                 pool_size: int = 2, connect_timeout_s: float = 5.0,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 backoff_initial_s: float = 0.02, backoff_max_s: float = 1.0) -> None:
        if pool_size < 1 or connect_timeout_s <= 0 or backoff_initial_s <= 0 or backoff_max_s < backoff_initial_s:
            raise ValueError("RpcClient: pool_size >= 1, connect_timeout_s > 0 and "
                             "0 < backoff_initial_s <= backoff_max_s are required")
        self._kind, self._host, self._port = parse_address(address)
        self.address = address
        self._identity = ClientIdentity(address, role, instance, cluster_id, secret or None)
        self._max_frame_bytes = max_frame_bytes
        self._connect_timeout_s = connect_timeout_s
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._slots: list[ClientConnection | None] = [None] * pool_size
        self._num_slots = pool_size
        self._connect_tasks: list[asyncio.Task[ClientConnection] | None] = [None] * pool_size
        self._next_slot = 0
        self.is_closed = False

    def call(self, method: Method[ReqT, RespT], request: ReqT, *, timeout_s: float) -> Coroutine[Any, Any, RespT]:
        """One unary call (await it); raises the RpcError subclass of the failure, DeadlineExceeded past timeout_s.

        A plain def returning the connection's coroutine: one coroutine frame less on every call.
        """
        if method.is_streaming:
            raise TypeError(f"{method.name} is a streaming method; use RpcClient.stream()")
        check_timeout(timeout_s)
        slot = self._next_slot
        if self._num_slots > 1:
            self._next_slot = (slot + 1) % self._num_slots
        conn = self._slots[slot]
        if conn is None or conn.is_closed:
            return self._connect_and_call(slot, method, request, timeout_s)
        return conn.call(method, request, timeout_s)

    async def _connect_and_call(self, slot: int, method: Method[ReqT, RespT], request: ReqT,
                                timeout_s: float) -> RespT:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        conn = await self._connect_slot(slot, timeout_s)
        return await conn.call(method, request, deadline - loop.time())

    async def stream(self, method: Method[ReqT, RespT], request: ReqT, *,
                     timeout_s: float) -> AsyncGenerator[RespT, None]:
        """Items of one server-streaming call; timeout_s bounds the whole stream.

        Leaving the iteration early (break, exception, task cancel) cancels the handler on the server;
        wrap it in contextlib.aclosing() to have that happen at once rather than when the generator is collected.
        """
        if not method.is_streaming:
            raise TypeError(f"{method.name} is a unary method; use RpcClient.call()")
        check_timeout(timeout_s)
        slot = self._next_slot
        self._next_slot = (slot + 1) % self._num_slots
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        conn = self._slots[slot]
        if conn is None or conn.is_closed:
            conn = await self._connect_slot(slot, timeout_s)
        state = conn.start_stream(method, request, deadline - loop.time())
        try:
            while True:
                payload = await conn.next_item(state)
                if payload is None:
                    return
                yield method.decode_response(payload)
        finally:
            conn.finish_stream(state)

    async def close(self) -> None:
        self.is_closed = True
        tasks = [task for task in self._connect_tasks if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for conn in self._slots:
            if conn is not None:
                conn.close_with_reason("client closed", is_error=False)
        self._slots = [None] * len(self._slots)

    async def _connect_slot(self, slot: int, timeout_s: float) -> ClientConnection:
        if self.is_closed:
            raise Unavailable(f"RPC client for {self.address} is closed")
        task = self._connect_tasks[slot]
        if task is None or task.done():
            task = asyncio.get_running_loop().create_task(self._connect_with_backoff(slot))
            task.add_done_callback(_mark_retrieved)  # its callers may all have given up (their own deadlines)
            self._connect_tasks[slot] = task
        try:
            return await asyncio.wait_for(asyncio.shield(task), timeout_s)
        except asyncio.TimeoutError:
            raise DeadlineExceeded(f"could not connect to {self.address} within {timeout_s:.3f}s") from None

    async def _connect_with_backoff(self, slot: int) -> ClientConnection:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._connect_timeout_s
        delay_s = self._backoff_initial_s
        num_attempts = 0
        while True:
            num_attempts += 1
            try:
                conn = await self._open(deadline - loop.time())
                self._slots[slot] = conn
                return conn
            except (OSError, asyncio.TimeoutError, Unavailable) as exc:
                error = exc
            time_left_s = deadline - loop.time()
            if time_left_s <= 0:
                raise Unavailable(f"cannot connect to {self.address} after {num_attempts} attempt(s) "
                                  f"in {self._connect_timeout_s}s: {error!r}")
            logger.debug("rpc: connecting to %s failed (%r); retrying in %.3fs", self.address, error, delay_s)
            await asyncio.sleep(min(delay_s * random.uniform(0.5, 1.0), time_left_s))
            delay_s = min(delay_s * 2, self._backoff_max_s)

    async def _open(self, timeout_s: float) -> ClientConnection:
        loop = asyncio.get_running_loop()

        def make_connection() -> ClientConnection:
            return ClientConnection(self._identity, self._max_frame_bytes)

        if self._kind == "unix":
            opening = loop.create_unix_connection(make_connection, self._host)
        else:
            opening = loop.create_connection(make_connection, self._host, self._port)
        _, conn = await asyncio.wait_for(opening, max(timeout_s, 0.001))
        try:
            await asyncio.wait_for(conn.handshake(), max(timeout_s, 0.001))
        except BaseException:
            conn.close_with_reason("handshake failed", is_error=False)
            raise
        return conn


def _mark_retrieved(task: asyncio.Task[ClientConnection]) -> None:
    """A failed connect is reported to every caller still waiting; with none left, it is not an error to log."""
    if not task.cancelled():
        task.exception()
