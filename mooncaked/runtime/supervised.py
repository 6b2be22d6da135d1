"""Long-lived background loops that cannot die silently.

1. An owner starts each long-lived loop with `start_supervised(name, run, ...)` and keeps the task it returns.
2. `supervise` runs `run()`. An exception (or a return, unless the loop may end by itself: `may_return`) is
   logged with its traceback, then either
   - `run()` starts again, after a delay that doubles from RESTART_DELAY_S up to MAX_RESTART_DELAY_S and starts
     over once a run lasted STABLE_AFTER_S (the loop's state lives in its owner; a fresh run picks it up), or,
     with `on_failure`, that is called with the reason and supervision ends: the owner marks its instance
     failed (unhealthy), its role stops and exits non-zero, and the process supervisor restarts it. Loops whose
     state a crash may have left inconsistent (a decode batch, a prefill queue) take this way.
3. The owner's `stop()` calls `stop_task(task)`: cancel, then await it; the owner's own cancellation still
   propagates.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)

RESTART_DELAY_S = 0.1
MAX_RESTART_DELAY_S = 30.0
STABLE_AFTER_S = 60.0


class LoopEnded(RuntimeError):
    """A long-lived loop returned although nothing cancelled it."""


async def supervise(name: str, run: Callable[[], Awaitable[None]], *,
                    on_failure: Callable[[str], None] | None = None, may_return: bool = False) -> None:
    """Run `run()` until cancelled (or, with `may_return`, until it returns); see the module docstring for what a
    failure does."""
    loop = asyncio.get_running_loop()
    delay_s = RESTART_DELAY_S
    num_restarts = 0
    while True:
        started = loop.time()
        try:
            await run()
            if may_return:
                return
            raise LoopEnded(f"{name} returned")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            reason = f"background loop {name} failed: {type(exc).__name__}: {exc}"
            if on_failure is not None:
                logger.exception("%s; the instance is marked failed", reason)
                on_failure(reason)
                return
            if loop.time() - started >= STABLE_AFTER_S:
                delay_s = RESTART_DELAY_S
            num_restarts += 1
            logger.exception("%s; restarting it in %.1f s (restart %d)", reason, delay_s, num_restarts)
        await asyncio.sleep(delay_s)
        delay_s = min(delay_s * 2, MAX_RESTART_DELAY_S)


def start_supervised(name: str, run: Callable[[], Awaitable[None]], *,
                     on_failure: Callable[[str], None] | None = None, may_return: bool = False) -> asyncio.Task[None]:
    """A task running `supervise(name, run, ...)`, named `name`; its starter owns it."""
    return asyncio.create_task(supervise(name, run, on_failure=on_failure, may_return=may_return), name=name)


async def stop_task(task: asyncio.Task[None] | None) -> None:
    """Cancel `task` and wait until it has ended. Only the task's own cancellation is absorbed: a cancellation
    of the caller propagates, and anything else the task raised is logged."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
    except Exception:
        logger.exception("task %s failed while it was being stopped", task.get_name())
