"""The three systems `mooncaked bench rpc` compares, both ends of each: our RPC, aiohttp HTTP, a bare msgpack echo.

1. The server end runs in a child process (serve_main, uvloop): it starts the system's server on 127.0.0.1,
   prints its port and serves until its stdin closes.
2. The client end runs in the measuring process: CLIENTS[system](port, concurrency) connects, makes one call
   (so connecting is not measured) and returns (call, close); every call carries the same payload().
3. The bare echo is the ceiling: the RPC layer's length-prefixed msgpack frames and coalesced writes
   (mooncaked.rpc.FramedProtocol) over one connection, with no handshake, ids, deadlines, dispatch or messages.
"""

from __future__ import annotations

import asyncio
import collections
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from mooncaked.rpc import FramedProtocol, Message, Method

_CLUSTER = "bench"
_SECRET = b"bench-secret"


@dataclass(frozen=True)
class EchoMessage(Message):
    request_id: str
    token_ids: list[int]
    text: str


ECHO = Method("bench.echo", EchoMessage, EchoMessage)


def payload() -> dict[str, Any]:
    """The content every system carries: a small request like the roles' control messages."""
    return {"request_id": "req-000001", "token_ids": list(range(1000, 1016)), "text": "mooncake " * 7}


# --- clients (this process) ---------------------------------------------------------------------

ClientPair = tuple[Callable[[], Awaitable[Any]], Callable[[], Awaitable[None]]]


async def _rpc_client(port: int, concurrency: int) -> ClientPair:
    from mooncaked.rpc import RpcClient

    client = RpcClient(f"tcp://127.0.0.1:{port}", role="bench", instance="bench-client", cluster_id=_CLUSTER,
                       secret=_SECRET, pool_size=1)
    request = EchoMessage(**payload())

    def call() -> Awaitable[Any]:
        # The coroutine a caller awaits: like the echo client's call(), one coroutine between worker and reply.
        return client.call(ECHO, request, timeout_s=10.0)

    await call()
    return call, client.close


async def _http_client(port: int, concurrency: int) -> ClientPair:
    import aiohttp

    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency))
    url, body = f"http://127.0.0.1:{port}/echo", payload()

    async def call() -> Any:
        async with session.post(url, json=body) as response:
            return await response.json()

    await call()
    return call, session.close


class _EchoClient(FramedProtocol):
    """Replies come back in order on one connection, so a FIFO of waiters matches them."""

    def __init__(self) -> None:
        super().__init__(1 << 20)
        self.waiters: collections.deque[asyncio.Future[Any]] = collections.deque()

    def on_frame(self, frame: dict[str, Any]) -> None:
        self.waiters.popleft().set_result(frame)


async def _echo_client(port: int, concurrency: int) -> ClientPair:
    loop = asyncio.get_running_loop()
    _, protocol = await loop.create_connection(_EchoClient, "127.0.0.1", port)
    body = payload()

    async def call() -> Any:
        waiter = loop.create_future()
        protocol.waiters.append(waiter)
        protocol.send_frame(body)
        return await waiter

    async def close() -> None:
        protocol.close_with_reason("bench done", is_error=False)

    return call, close


CLIENTS: dict[str, Callable[[int, int], Awaitable[ClientPair]]] = {
    "rpc": _rpc_client, "http": _http_client, "echo": _echo_client}


# --- servers (child process) --------------------------------------------------------------------


class _EchoServer(FramedProtocol):
    def __init__(self) -> None:
        super().__init__(1 << 20)

    def on_frame(self, frame: dict[str, Any]) -> None:
        self.send_frame(frame)


async def _serve(system: str) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_reader(sys.stdin.fileno(), stop.set)
    close: Callable[[], Awaitable[None]]
    if system == "rpc":
        port, close = await _start_rpc_server()
    elif system == "http":
        port, close = await _start_http_server()
    else:
        listener = await loop.create_server(_EchoServer, "127.0.0.1", 0)
        port = listener.sockets[0].getsockname()[1]

        async def close() -> None:
            listener.close()
    print(port, flush=True)
    await stop.wait()
    await close()


async def _start_rpc_server() -> tuple[int, Callable[[], Awaitable[None]]]:
    from mooncaked.rpc import CallContext, RpcServer

    server = RpcServer(role="bench", instance="bench-server", cluster_id=_CLUSTER, secret=_SECRET,
                       max_inflight_calls=4096)

    async def echo(request: EchoMessage, ctx: CallContext) -> EchoMessage:
        return request

    server.add_method(ECHO, echo, is_eager=True)
    port = await server.start_tcp("127.0.0.1", 0)

    async def close() -> None:
        await server.stop(1.0)

    return port, close


async def _start_http_server() -> tuple[int, Callable[[], Awaitable[None]]]:
    from aiohttp import web

    async def echo(request: web.Request) -> web.Response:
        return web.json_response(await request.json())

    app = web.Application()
    app.router.add_post("/echo", echo)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return int(port), runner.cleanup


def serve_main(system: str) -> None:
    """Entry point of the server process: prints its port, serves until its stdin closes."""
    import uvloop

    uvloop.run(_serve(system))
