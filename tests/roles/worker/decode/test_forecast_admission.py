"""RESERVE under `early_rejection_predicted` on a live decode instance: admitted on the memory forecast at the
request's decode start rather than on the pages free now; a request whose pages free in time waits and decodes,
one whose forecast was wrong is told to move (pages_not_freed) at its page deadline, and LOAD's free pages never
go negative."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from mooncaked.config import Config
from mooncaked.roles.base import PeerClients
from mooncaked.roles.worker.decode.role import DecodeRole
from mooncaked.roles.worker.messages import (DECODE, LOAD, RESERVE, DecodeRequest, LoadReply, LoadRequest,
                                             ReserveRequest, SamplingSpec)
from mooncaked.rpc import InvalidArgument, ResourceExhausted, RpcClient
from tests.roles.cluster_fixtures import cluster_config, instance, running_roles
from tests.roles.test_disagg_roles import keys_for

DEADLINE_S = 30.0
NUM_PAGES = 16  # 16 tokens a page: 256 tokens


@asynccontextmanager
async def decode_instance(tmp_path: Path) -> AsyncIterator[tuple[Config, RpcClient, DecodeRole]]:
    config = cluster_config(tmp_path, [instance("s0", "store"), instance("d0", "decode"), instance("c0", "conductor")],
                            # before any step is measured, a step is predicted to take the TBT SLO: 0.1 s here
                            scheduler={"admission": "early_rejection_predicted", "tbt_slo_ms": 100.0},
                            worker={"num_kv_pages": NUM_PAGES, "page_wait_s": 0.3, "profile_s": 0.0})
    async with running_roles(config, ["s0", "d0"]) as roles:
        role = roles["d0"]
        assert isinstance(role, DecodeRole)
        clients = PeerClients(config, config.instance_named("c0"))
        try:
            yield config, clients.for_instance(config.instance_named("d0")), role
        finally:
            await clients.close()


def prompt(seed: int, length: int) -> list[int]:
    return [random.Random(seed).randrange(3, 300) for _ in range(length)]


async def reserve(decode: RpcClient, config: Config, request_id: str, tokens: list[int], max_tokens: int,
                  **forecast: float) -> tuple[bool, str]:
    request = ReserveRequest(request_id, keys_for(config, tokens), len(tokens), max_tokens, 60_000,
                             is_inline_prefill=True, **forecast)  # type: ignore[arg-type]
    reply = await decode.call(RESERVE, request, timeout_s=DEADLINE_S)
    return reply.is_accepted, reply.reason


async def decode_all(decode: RpcClient, config: Config, request_id: str, tokens: list[int], max_tokens: int) -> int:
    spec = SamplingSpec(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    num_tokens = 0
    async for item in decode.stream(DECODE, DecodeRequest(request_id, tokens, keys_for(config, tokens), spec),
                                    timeout_s=DEADLINE_S):
        num_tokens += len(item.tokens)
    return num_tokens


async def load(decode: RpcClient) -> LoadReply:
    reply = await decode.call(LOAD, LoadRequest(), timeout_s=DEADLINE_S)
    assert reply.num_free_pages >= 0
    return reply


async def test_a_request_whose_pages_free_before_its_decode_start_waits_for_them(tmp_path: Path) -> None:
    async with decode_instance(tmp_path) as (config, decode, role):
        long_tokens, next_tokens = prompt(1, 40), prompt(2, 40)
        assert await reserve(decode, config, "long", long_tokens, 200, predicted_output_tokens=2) == (True, "")
        # 15 of the 16 pages, predicted to decode for 2 tokens: freed long before "next" starts decoding
        assert await reserve(decode, config, "next", next_tokens, 100, decode_start_s=30.0) == (True, "")
        reserved = await load(decode)  # pages are wanted only from DECODE on
        assert reserved.num_queued_pages == 0 and reserved.num_free_pages == NUM_PAGES
        # the same request starting now would find the pages held: refused before any prefill
        accepted, reason = await reserve(decode, config, "now", next_tokens, 100)
        assert not accepted and reason.startswith("memory: needs 9 KV pages")
        spec = SamplingSpec(max_tokens=200, temperature=0.0, ignore_eos=True)
        long_stream = decode.stream(DECODE, DecodeRequest("long", long_tokens, keys_for(config, long_tokens), spec),
                                    timeout_s=DEADLINE_S)
        num_long_tokens = len((await anext(long_stream)).tokens)  # decoding: its 15 pages are taken
        next_done = asyncio.ensure_future(decode_all(decode, config, "next", next_tokens, 100))
        async for item in long_stream:
            num_long_tokens += len(item.tokens)
        assert num_long_tokens == 200
        assert await next_done == 100  # it waited for long's pages
        idle = await load(decode)
        assert idle.num_free_pages == NUM_PAGES and idle.num_queued_pages == 0


async def test_a_wrong_forecast_tells_the_request_to_move_at_its_page_deadline(tmp_path: Path) -> None:
    async with decode_instance(tmp_path) as (config, decode, role):
        next_tokens = prompt(4, 40)
        assert role.worker.pages is not None
        # pages held beyond any forecast (a sequence running far longer than predicted): the forecast admits "next"
        held = role.worker.pages.allocate(15, owner="longer-than-predicted")
        try:
            assert await reserve(decode, config, "next", next_tokens, 100, decode_start_s=0.2) == (True, "")
            with pytest.raises(ResourceExhausted, match="pages_not_freed"):
                await decode_all(decode, config, "next", next_tokens, 100)  # at 0.2 s + page_wait_s
        finally:
            role.worker.pages.free(held, "longer-than-predicted")
        after = await load(decode)
        assert after.num_queued_pages == 0 and after.num_free_pages == NUM_PAGES  # "next" is gone, nothing leaked


async def test_an_unclaimed_reservation_expires_without_another_reserve_and_leases_are_bounded(
        tmp_path: Path) -> None:
    """A reservation whose DECODE never comes is given back when its lease runs out, not at the next RESERVE; a
    lease longer than store.max_lease_ms is refused."""
    async with decode_instance(tmp_path) as (config, decode, role):
        tokens = prompt(5, 40)
        request = ReserveRequest("lost", keys_for(config, tokens), len(tokens), 8, 200, is_inline_prefill=True)
        assert (await decode.call(RESERVE, request, timeout_s=DEADLINE_S)).is_accepted
        assert (await load(decode)).num_waiting == 1
        deadline = asyncio.get_running_loop().time() + 5.0  # its 0.2 s lease and one expiry period, with room
        while (await load(decode)).num_waiting and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        idle = await load(decode)
        assert idle.num_waiting == 0 and idle.num_free_pages == NUM_PAGES
        too_long = ReserveRequest("long", keys_for(config, tokens), len(tokens), 8,
                                  config.store.max_lease_ms + 1, is_inline_prefill=True)
        with pytest.raises(InvalidArgument, match="lease_ms must be at most store.max_lease_ms"):
            await decode.call(RESERVE, too_long, timeout_s=DEADLINE_S)
