"""The room RESERVE calls wait on: a decode instance's reservation book frees it (pages, a batch slot or store
space given back), and waiting calls wake to look again.

1. `freed()` counts a change and wakes every waiter.
2. `wait_until(refusal, timeout_s)`: until `refusal()` says "" or the timeout runs out (admission.wait_for_room).
3. `wait_changed(since, timeout_s)`: until a change after the count `since` read before a try, or the timeout
   (admission.allocate_store: a waiter that read the count first misses no wake-up).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable


class Room:
    """Wakes RESERVE calls waiting for KV pages or a batch slot (owned by the ReservationBook)."""

    def __init__(self) -> None:
        self._changed = asyncio.Condition()
        self.num_changes = 0  # how many times room was freed: a waiter that read it before a try misses no wake-up

    async def freed(self) -> None:
        async with self._changed:
            self.num_changes += 1
            self._changed.notify_all()

    async def wait_changed(self, since: int, timeout_s: float) -> None:
        """Until room was freed after `num_changes` read `since`, or `timeout_s` runs out."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(timeout_s, 0.0)), self._changed:
                await self._changed.wait_for(lambda: self.num_changes != since)

    async def wait_until(self, refusal: Callable[[], str], timeout_s: float) -> str:
        """Wait until `refusal()` is "" or `timeout_s` runs out; returns the last refusal ("" once there is room)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        async with self._changed:
            while reason := refusal():
                left_s = deadline - loop.time()
                if left_s <= 0:
                    return reason
                try:
                    await asyncio.wait_for(self._changed.wait(), left_s)
                except TimeoutError:
                    return refusal()
            return ""
