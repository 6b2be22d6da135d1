"""Queue order on the workers: RESERVE calls waiting for room on a decode instance take it interactive first,
then by priority, then by arrival, and LOAD counts them as the instance's queue (in-process store and decode
roles, tiny random model)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from mooncaked.roles.base import PeerClients
from mooncaked.roles.worker.decode.role import DecodeRole
from mooncaked.roles.worker.messages import (LOAD, RESERVE, UNRESERVE, LoadReply, LoadRequest, ReserveReply,
                                             ReserveRequest, UnreserveRequest)
from tests.roles.cluster_fixtures import cluster_config, instance, running_roles


async def test_waiting_reservations_take_room_by_class_then_priority(tmp_path: Path) -> None:
    config = cluster_config(tmp_path, [instance("s0", "store"), instance("d0", "decode")],
                            worker={"max_batch_size": 1, "profile_s": 0}, scheduler={"admission": "none"})
    async with running_roles(config, ["s0", "d0"]) as roles:
        decode = roles["d0"]
        assert isinstance(decode, DecodeRole)
        peers = PeerClients(config, config.instance_named("s0"))
        client = peers.for_instance(config.instance_named("d0"))

        async def reserve(request_id: str, is_batch: bool = False, priority: int = 0) -> ReserveReply:
            request = ReserveRequest(request_id, [], 20, 4, 30_000, is_inline_prefill=True, priority=priority,
                                     is_batch=is_batch)
            reply: ReserveReply = await client.call(RESERVE, request, timeout_s=20.0)
            return reply

        try:
            assert (await reserve("holder")).is_accepted
            waiting = {}
            for name, is_batch, priority in [("batch", True, -9), ("late", False, 5), ("urgent", False, -1),
                                             ("later", False, 5)]:
                waiting[name] = asyncio.ensure_future(reserve(name, is_batch, priority))
                deadline = time.monotonic() + 10
                while len(decode.admission.waiting) < len(waiting):  # each arrives before the next (arrival order)
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.01)
            load: LoadReply = await client.call(LOAD, LoadRequest(), timeout_s=5.0)
            # the holder's prompt is not prefilled (nothing claimed it): four calls wait behind it
            assert (load.num_running, load.num_waiting, load.num_prefilling, load.num_reserving) == (0, 1, 1, 4)
            order = []
            holder = "holder"
            while waiting:
                await client.call(UNRESERVE, UnreserveRequest(holder), timeout_s=5.0)
                done, _ = await asyncio.wait(waiting.values(), timeout=10, return_when=asyncio.FIRST_COMPLETED)
                [holder] = [name for name, task in waiting.items() if task in done]
                assert waiting.pop(holder).result().is_accepted
                order.append(holder)
            assert order == ["urgent", "late", "later", "batch"]
        finally:
            await peers.close()
