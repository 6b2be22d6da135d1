"""Per-key locks: one holder per key at a time, and nothing kept for keys no longer in use."""

from __future__ import annotations

import asyncio

from mooncaked.runtime.keyed_locks import KeyedLocks


async def test_one_holder_per_key_and_no_lock_left_behind() -> None:
    locks = KeyedLocks()
    inside: dict[str, int] = {}
    most_inside: dict[str, int] = {}

    async def work(key: str) -> None:
        async with locks.hold(key):
            inside[key] = inside.get(key, 0) + 1
            most_inside[key] = max(most_inside.get(key, 0), inside[key])
            await asyncio.sleep(0.001)
            inside[key] -= 1

    await asyncio.gather(*(work(f"client-{i % 7}") for i in range(70)))
    assert most_inside == {f"client-{i}": 1 for i in range(7)}
    assert len(locks) == 0

    cancelled = asyncio.ensure_future(work("client-0"))
    async with locks.hold("client-0"):
        await asyncio.sleep(0)
        cancelled.cancel()  # a waiter that gives up
        await asyncio.gather(cancelled, return_exceptions=True)
    assert len(locks) == 0
