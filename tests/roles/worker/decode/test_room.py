"""The room RESERVE calls wait on (decode/room.py): woken when room is freed, given up at the deadline."""

from __future__ import annotations

import asyncio

from mooncaked.roles.worker.decode.room import Room


async def test_a_waiting_reserve_wakes_when_room_is_freed_and_gives_up_at_its_deadline() -> None:
    room = Room()
    free = {"pages": 0}

    def refusal() -> str:
        return "" if free["pages"] >= 2 else "memory: wait"

    waiter = asyncio.ensure_future(room.wait_until(refusal, 5.0))
    await asyncio.sleep(0)
    assert not waiter.done()
    free["pages"] = 1
    await room.freed()
    await asyncio.sleep(0)
    assert not waiter.done()  # woken, but still not enough room: waits again
    free["pages"] = 2
    await room.freed()
    assert await asyncio.wait_for(waiter, 1.0) == ""
    free["pages"] = 0
    assert await room.wait_until(refusal, 0.01) == "memory: wait"
