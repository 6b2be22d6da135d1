"""RESERVE when this host's store is full of space other reservations hold (leased, being written): under the
waiting admission policies the call waits for that space and is accepted once a reservation lets go of it; under
the others it is refused at once, naming the store. Nothing is left allocated either way."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from mooncaked.roles.base import PeerClients
from mooncaked.roles.store import StoreRole
from mooncaked.roles.worker.decode.role import DecodeRole
from mooncaked.roles.worker.messages import RESERVE, UNRESERVE, ReserveRequest, UnreserveRequest
from tests.roles.cluster_fixtures import cluster_config, instance, running_roles
from tests.roles.test_disagg_roles import keys_for

BLOCK_NBYTES = 8192  # the tiny model's KV block of 16 tokens
NUM_STORE_BLOCKS = 128  # the smallest store (1 MiB): two reservations of 1000 tokens (63 blocks each), not three
NUM_TOKENS = 1000
DEADLINE_S = 20.0


def prompt(seed: int, num_tokens: int = NUM_TOKENS) -> list[int]:
    return [random.Random(seed).randrange(3, num_tokens + 3) for _ in range(num_tokens)]


@pytest.mark.parametrize("admission", ["none", "early_rejection"])
@pytest.mark.parametrize("num_tokens", [NUM_TOKENS, 40])
async def test_a_reserve_waits_for_store_space_another_reservation_frees(tmp_path: Path, admission: str,
                                                                         num_tokens: int) -> None:
    """40 tokens: its 2 full blocks fit in the 2 blocks left, its partial tail does not (a partial allocation,
    given back before it waits, without waking itself: no retry loop)."""
    config = cluster_config(tmp_path, [instance("s0", "store"), instance("d0", "decode"), instance("c0", "conductor")],
                            store={"dram_bytes": NUM_STORE_BLOCKS * BLOCK_NBYTES},
                            scheduler={"admission": admission}, worker={"profile_s": 0.0, "abort_grace_s": 0.0})
    async with running_roles(config, ["s0", "d0"]) as roles:
        role = roles["d0"]
        assert isinstance(role, DecodeRole) and role.worker.block_nbytes == BLOCK_NBYTES
        clients = PeerClients(config, config.instance_named("c0"))
        decode = clients.for_instance(config.instance_named("d0"))
        try:
            requests = {name: ReserveRequest(name, keys_for(config, prompt(seed)), NUM_TOKENS, 4, 60_000)
                        for seed, name in enumerate(("first", "filler"))}
            tokens = prompt(2, num_tokens)
            requests["second"] = ReserveRequest("second", keys_for(config, tokens), num_tokens, 4, 60_000)
            for name in ("first", "filler"):
                assert (await decode.call(RESERVE, requests[name], timeout_s=DEADLINE_S)).is_accepted
            second = asyncio.ensure_future(decode.call(RESERVE, requests["second"], timeout_s=DEADLINE_S))
            if admission != "none":
                reply = await second
                assert not reply.is_accepted and reply.reason.startswith("store: store full")
            else:
                async with asyncio.timeout(DEADLINE_S):
                    while "second" not in role.reservations.by_id:  # it reserved pages and tries the store
                        await asyncio.sleep(0.01)
                changes = role.reservations.room.num_changes
                await asyncio.sleep(0.2)  # a window in which a retry loop would wake itself many times
                assert not second.done() and role.reservations.room.num_changes == changes
                await decode.call(UNRESERVE, UnreserveRequest("first"), timeout_s=DEADLINE_S)
                reply = await asyncio.wait_for(second, DEADLINE_S)
                assert reply.is_accepted and len(reply.destinations) == -(-num_tokens // 16)
            for name in ("filler", "second") if admission == "none" else ("first", "filler"):
                await decode.call(UNRESERVE, UnreserveRequest(name), timeout_s=DEADLINE_S)
            assert not role.reservations.by_id
            store = roles["s0"]
            assert isinstance(store, StoreRole)
            async with asyncio.timeout(DEADLINE_S):
                while store.service.core.stats()["used_bytes"]:  # the handles' aborts run after UNRESERVE answered
                    await asyncio.sleep(0.01)
        finally:
            await clients.close()
