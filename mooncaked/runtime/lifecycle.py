"""Running one role object until it is told to stop.

1. `run_role(make_role, ...)` starts a uvloop event loop and builds the role inside it.
2. `await role.start()`; then sd_notify READY=1 and, when systemd asked for it, a WATCHDOG=1 heartbeat task. A
   process running one role (`run_role`) then collects its start-up garbage and freezes what is left (the model,
   the tokenizer, the imported modules: a few hundred thousand objects) out of the garbage collector's reach: a
   full collection no longer walks them while serving (one over a tiny-model worker's objects took ~0.15 s on
   this CPU, a pause in whatever step it fell into), nor at exit (2 s of a worker's shutdown went to the
   interpreter's last collections over them).
3. SIGTERM or SIGINT (or the caller's stop event) sets the stop event: sd_notify STOPPING=1, then
   `await role.stop()`, which stops accepting, drains in-flight work up to its deadline, cancels the rest and
   releases resources, in that order.
4. The heartbeat task is cancelled and awaited; the exit code is 0 after a clean stop.
5. A role with a `failed` event (prefill, decode: a tensor-parallel rank exited) that gets set is stopped the
   same way, and the exit code is EXIT_FAILED, so a supervisor restarts it.

A role that cannot be built or started exits at once: with EXIT_FATAL (2) and sd_notify STATUS= naming the
error when it is a configuration or load error (`is_fatal_start_error`), which a restart cannot fix; with
EXIT_FAILED (1) otherwise (a port still held by a previous process, say), which a restart may fix.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import signal
from collections.abc import Callable
from typing import Protocol

import uvloop

from mooncaked.runtime.errors import StartupError
from mooncaked.runtime.sdnotify import Notifier
from mooncaked.runtime.supervised import start_supervised, stop_task

logger = logging.getLogger(__name__)

EXIT_FAILED = 1
EXIT_FATAL = 2
# OSErrors at start that name a configured path or address: wrong until the configuration changes.
_FATAL_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM, errno.EROFS,
                           errno.EADDRNOTAVAIL, errno.ENAMETOOLONG})


class Role(Protocol):
    """What every role object offers the runner."""

    name: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


async def serve(role: Role, notifier: Notifier, watchdog_interval_s: float | None,
                stop_event: asyncio.Event | None = None, is_freezing_gc: bool = False) -> int:
    """Start `role`, wait for a signal (or `stop_event`), stop it; returns the exit code. `is_freezing_gc`: once
    started, move every live object to the collector's permanent generation (for a process that runs only this)."""
    loop = asyncio.get_running_loop()
    stop = stop_event or asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await role.start()
    except Exception as exc:
        exit_code = start_failed(role.name, exc, notifier)
        try:
            await role.stop()  # releases what the failed start had taken
        except Exception:
            logger.exception("%s: releasing what its failed start had taken failed too", role.name)
        return exit_code
    if is_freezing_gc:
        gc.collect()
        gc.freeze()
    notifier.ready()
    logger.info("%s ready", role.name)
    heartbeat = _start_heartbeat(notifier, watchdog_interval_s)
    failed = getattr(role, "failed", None)
    is_failed = await _wait_stop_or_failure(stop, failed if isinstance(failed, asyncio.Event) else None)
    logger.info("%s stopping%s", role.name, " after a failure" if is_failed else "")
    notifier.stopping()
    try:
        await role.stop()
    finally:
        await stop_task(heartbeat)
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
    logger.info("%s stopped", role.name)
    return EXIT_FAILED if is_failed else 0


async def _wait_stop_or_failure(stop: asyncio.Event, failed: asyncio.Event | None) -> bool:
    """Wait until `stop` or `failed` is set; True when the role failed."""
    if failed is None:
        await stop.wait()
        return False
    waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(failed.wait())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in waits:
            task.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
    return failed.is_set()


def is_fatal_start_error(exc: BaseException) -> bool:
    """Whether a failure to build or start a role is a configuration or load error (not worth a restart)."""
    return isinstance(exc, StartupError) or (isinstance(exc, OSError) and exc.errno in _FATAL_ERRNOS)


def start_failed(name: str, exc: Exception, notifier: Notifier) -> int:
    """Log why `name` could not start and tell the supervisor (sd_notify STATUS=); returns the exit code."""
    if not is_fatal_start_error(exc):
        logger.error("%s failed to start: %s", name, exc, exc_info=logger.isEnabledFor(logging.DEBUG))
        return EXIT_FAILED
    reason = "; ".join(str(exc).splitlines()) or type(exc).__name__
    logger.error("%s cannot start: %s (a configuration or load error: restarting will not help)", name, reason)
    notifier.status(f"cannot start: {reason}")
    return EXIT_FATAL


def _start_heartbeat(notifier: Notifier, interval_s: float | None) -> asyncio.Task[None] | None:
    if not interval_s or not notifier.is_enabled:
        return None
    return start_supervised("sd-watchdog", lambda: _heartbeat(notifier, interval_s))


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


def run_role(make_role: Callable[[], Role], notifier: Notifier, watchdog_interval_s: float | None,
             stop_event: asyncio.Event | None = None) -> int:
    async def main() -> int:
        try:
            role = make_role()
        except Exception as exc:
            return start_failed("mooncaked", exc, notifier)
        return await serve(role, notifier, watchdog_interval_s, stop_event, is_freezing_gc=True)

    return uvloop.run(main())
