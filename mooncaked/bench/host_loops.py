"""In-process roles on the hosts of a test network (mooncaked/bench/testnet.py): one thread per host.

1. `HostLoop(net, host)` starts a thread that enters the host's network namespace (setns(2) acts on the calling
   thread only; threads it starts, a role's executor and compute threads, and processes it spawns inherit it) and
   runs an event loop there. Every socket a coroutine on that loop opens is the host's: its addresses, its NICs.
2. `call(coroutine_function, timeout_s)` runs a coroutine on that loop and returns its result; the calling
   thread waits at most `timeout_s` (and a little more). `submit` starts one and returns its future.
3. `close()` stops the loop (after the caller has stopped the host's roles through `call`) and joins the thread.

One process holds every host's roles, so the model and torch load once; the roles still talk to one another only
through the test network's links.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import os
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar

from mooncaked.bench.testnet import TestNet

T = TypeVar("T")

_CLONE_NEWNET = 0x40000000
_START_TIMEOUT_S = 10.0


def enter_namespace(namespace: str) -> None:
    """Move the calling thread into the named network namespace (`ip netns add` made it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {namespace} failed")
    finally:
        os.close(fd)


class HostLoop:
    """Owns one thread inside a host's namespace and the event loop it runs."""

    def __init__(self, net: TestNet, host: int) -> None:
        self.host = host
        self._namespace = net.namespace(host)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"testnet-host{host}", daemon=True)
        self._thread.start()
        if not self._ready.wait(_START_TIMEOUT_S) or self._loop is None:
            raise RuntimeError(f"host {host}'s loop did not start: {self._error!r}")

    def _run(self) -> None:
        try:
            enter_namespace(self._namespace)
            loop = asyncio.new_event_loop()
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        asyncio.set_event_loop(loop)
        self._loop = loop
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def submit(self, function: Callable[[], Awaitable[T]], timeout_s: float) -> concurrent.futures.Future[T]:
        """Start `function()` on this host's loop, cancelled after `timeout_s`; its future."""
        assert self._loop is not None

        async def bounded() -> T:
            async with asyncio.timeout(timeout_s):
                return await function()

        return asyncio.run_coroutine_threadsafe(bounded(), self._loop)

    def call(self, function: Callable[[], Awaitable[T]], timeout_s: float) -> T:
        """Run `function()` on this host's loop; its result, or TimeoutError after `timeout_s` (the coroutine is
        then cancelled)."""
        return self.result(self.submit(function, timeout_s), timeout_s)

    def result(self, future: concurrent.futures.Future[T], timeout_s: float) -> T:
        """What `submit(..., timeout_s)` started gave; the thread waits a little past the coroutine's own end."""
        try:
            return future.result(timeout_s + 5.0)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"host {self.host}: no result within {timeout_s:g}s") from None

    def close(self, timeout_s: float = 10.0) -> None:
        if self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)
