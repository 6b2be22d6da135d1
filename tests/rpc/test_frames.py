"""The deadline wheel: in-flight calls expire on time; finished ones are forgotten at once."""

from __future__ import annotations

import asyncio

from mooncaked.rpc.frames import DeadlineWheel


async def test_only_calls_still_in_flight_expire_and_finished_ones_leave_nothing() -> None:
    expired: list[int] = []
    wheel = DeadlineWheel(expired.append, tick_s=0.01)
    for key in range(1, 1001):  # a burst with one long deadline, then calls of their own deadlines
        wheel.add(key, 3600.0 if key <= 500 else 3600.0 + key)
    wheel.add(2000, 0.02)
    wheel.add(2001, 0.02)
    for key in range(1, 1001):
        wheel.discard(key)
    wheel.discard(2001)
    wheel.discard(424242)  # never added: ignored
    assert len(wheel) == 1 and len(wheel._buckets) == 1
    assert len(wheel._bucket_heap) <= 2 * len(wheel._buckets) + 64, "stale bucket times are dropped"
    async with asyncio.timeout(2):
        while not expired:
            await asyncio.sleep(0.01)
    assert expired == [2000] and len(wheel) == 0
    wheel.close()
