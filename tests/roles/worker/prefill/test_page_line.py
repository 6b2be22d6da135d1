"""The prefill instance's line for KV pages: prompts that do not fit the free pages wait their turn in arrival
order instead of being refused, a waiter past its deadline is refused with the counts, and a live instance with
room for one prompt at a time answers every one of several concurrent prompts."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncaked.roles.base import PeerClients
from mooncaked.roles.worker.messages import (LOAD, PREFILL, LoadRequest, PrefillReply, PrefillRequest,
                                             SamplingSpec)
from mooncaked.roles.worker.prefill.page_line import PageLine
from mooncaked.roles.worker.prefill.role import PrefillRole
from mooncaked.rpc import ResourceExhausted, RpcClient, Unavailable
from tests.roles.cluster_fixtures import cluster_config, instance, running_roles
from tests.roles.test_disagg_roles import keys_for


class Pages:
    """A page count the test owns, as the worker's allocator would be."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.num_free = num_pages


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 8), min_size=1, max_size=12), st.randoms(use_true_random=False))
def test_prompts_take_their_pages_in_arrival_order_and_never_more_than_are_free(needs: list[int],
                                                                                rng: random.Random) -> None:
    async def run() -> list[int]:
        pages = Pages(8)
        line = PageLine(lambda: pages.num_free, pages.num_pages)
        granted: list[int] = []

        async def prompt(index: int, num_pages: int) -> None:
            await line.wait_turn(f"r{index}", num_pages * 16, num_pages, timeout_s=30.0)
            assert pages.num_free >= num_pages
            pages.num_free -= num_pages  # taken before the next await, as plan_prompt_kv does
            granted.append(index)
            for _ in range(rng.randrange(1, 4)):
                await asyncio.sleep(0)
            pages.num_free += num_pages
            line.freed()

        async with asyncio.timeout(30):
            await asyncio.gather(*(prompt(i, n) for i, n in enumerate(needs)))
        assert pages.num_free == pages.num_pages and not line.waiting
        return granted

    assert asyncio.run(run()) == list(range(len(needs)))  # nobody passed over by a later, smaller prompt


async def test_a_prompt_still_waiting_at_its_deadline_is_refused_with_the_counts() -> None:
    pages = Pages(4)
    line = PageLine(lambda: pages.num_free, pages.num_pages)
    pages.num_free = 1
    with pytest.raises(ResourceExhausted, match="3 pages needed, 1 of 4 free after waiting 0.1 s"):
        await line.wait_turn("r", 40, 3, timeout_s=0.1)
    assert not line.waiting
    waiter = asyncio.create_task(line.wait_turn("s", 40, 3, timeout_s=30.0))
    await asyncio.sleep(0)
    line.close("p0 stopped taking prefills")
    with pytest.raises(Unavailable, match="stopped taking prefills"):
        await waiter
    with pytest.raises(Unavailable):
        await line.wait_turn("t", 10, 1, timeout_s=30.0)


async def test_a_live_prefill_instance_answers_more_prompts_than_its_pages_hold_at_once(tmp_path: Path) -> None:
    # 8 pages of 16 tokens; each prompt takes 7: one at a time
    config = cluster_config(tmp_path, [instance("s0", "store"), instance("p0", "prefill"),
                                       instance("c0", "conductor")],
                            worker={"num_kv_pages": 8, "profile_s": 0.0})
    prompts = [[random.Random(i).randrange(3, 300) for _ in range(100)] for i in range(3)]
    async with running_roles(config, ["s0", "p0"]) as roles:
        role = roles["p0"]
        assert isinstance(role, PrefillRole) and role.worker.pages is not None and role.page_line is not None
        clients = PeerClients(config, config.instance_named("c0"))
        calls: list[asyncio.Future[PrefillReply]] = []
        try:
            prefill: RpcClient = clients.for_instance(config.instance_named("p0"))
            spec = SamplingSpec(max_tokens=1, temperature=0.0)
            held = role.worker.pages.allocate(8, owner="test")  # every page taken: all three wait in line
            calls += [asyncio.ensure_future(prefill.call(PREFILL, PrefillRequest(f"r{i}", tokens,
                                                                                keys_for(config, tokens), spec),
                                                        timeout_s=60))
                     for i, tokens in enumerate(prompts)]
            async with asyncio.timeout(30):
                while (load := await prefill.call(LOAD, LoadRequest(), timeout_s=10)).num_waiting < 3:
                    await asyncio.sleep(0.01)  # polls for the calls' arrival: they wait until the pages free
            assert load.num_queued_tokens == 300 and sorted(load.held_request_ids) == ["r0", "r1", "r2"]
            role.worker.pages.free(held, "test")
            role.page_line.freed()
            replies = await asyncio.gather(*calls)  # before the line: two of them were refused at once
            assert all(reply.first_token.token_id >= 0 for reply in replies)
            load = await prefill.call(LOAD, LoadRequest(), timeout_s=10)
            assert load.num_free_pages == 8 and load.num_waiting == 0
        finally:
            for call in calls:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
            await clients.close()
