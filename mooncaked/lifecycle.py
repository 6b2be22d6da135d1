"""Running one role object until it is told to stop.

1. `run_role(make_role, ...)` starts a uvloop event loop and builds the role inside it.
2. `await role.start()`; then sd_notify READY=1 and, when systemd asked for it, a WATCHDOG=1 heartbeat task.
3. SIGTERM or SIGINT sets the stop event: sd_notify STOPPING=1, then `await role.stop()`, which stops accepting,
   drains in-flight work up to its deadline, cancels the rest and releases resources, in that order.
4. The heartbeat task is cancelled and awaited; the exit code is 0 after a clean stop, 1 if start failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from typing import Protocol

import uvloop

from mooncaked.sdnotify import Notifier

logger = logging.getLogger(__name__)


class Role(Protocol):
    """What every role object offers the runner."""

    name: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


async def serve(role: Role, notifier: Notifier, watchdog_interval_s: float | None,
                stop_event: asyncio.Event | None = None) -> int:
    """Start `role`, wait for a signal (or `stop_event`), stop it; returns the exit code."""
    loop = asyncio.get_running_loop()
    stop = stop_event or asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await role.start()
    except Exception as exc:
        logger.error("%s failed to start: %s", role.name, exc, exc_info=logger.isEnabledFor(logging.DEBUG))
        with contextlib.suppress(Exception):
            await role.stop()
        return 1
    notifier.ready()
    logger.info("%s ready", role.name)
    heartbeat = _start_heartbeat(notifier, watchdog_interval_s)
    await stop.wait()
    logger.info("%s stopping", role.name)
    notifier.stopping()
    try:
        await role.stop()
    finally:
        if heartbeat is not None:
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeat
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
    logger.info("%s stopped", role.name)
    return 0


def _start_heartbeat(notifier: Notifier, interval_s: float | None) -> asyncio.Task[None] | None:
    if not interval_s or not notifier.is_enabled:
        return None
    return asyncio.create_task(_heartbeat(notifier, interval_s), name="sd-watchdog")


async def _heartbeat(notifier: Notifier, interval_s: float) -> None:
    while True:
        notifier.watchdog()
        await asyncio.sleep(interval_s)


def watchdog_interval(watchdog_usec: str | None) -> float | None:
    """Half of systemd's WATCHDOG_USEC, in seconds, as sd_watchdog_enabled(3) advises."""
    if not watchdog_usec:
        return None
    try:
        usec = int(watchdog_usec)
    except ValueError:
        logger.warning("ignoring WATCHDOG_USEC=%r: not an integer", watchdog_usec)
        return None
    return usec / 2e6 if usec > 0 else None


def run_role(make_role: Callable[[], Role], notifier: Notifier, watchdog_interval_s: float | None) -> int:
    async def main() -> int:
        return await serve(make_role(), notifier, watchdog_interval_s)

    return uvloop.run(main())
