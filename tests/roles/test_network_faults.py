"""Network faults under one elastic cluster on a test network (tests/roles/network_fleet.py: 4 hosts of 2 NICs,
host 1 at a tenth of the others' rate, etcd on rail 1), shared by the module's tests:

(b) one NIC of two down during a large prefix load between hosts: the load completes on the other NIC, the
    first token is right, and every block it committed is whole (a later prefill reuses all of them and gets the
    same token);
(c) a slow link: after one measured fetch over it, the conductor recomputes a prefix held only behind it
    instead of fetching it (Algorithm 1's line 5 would fetch; sched/prefix_plans.py);
(e) etcd cut off from the leading conductor: it stops leading within the lease TTL, the other takes over, never
    two leaders at once, both keep serving within their deadlines, and the fleet view converges after the heal.
(a) and (d) are tests/bench/test_bench_network.py's cluster rounds and tests/roles/test_store_gray_failure.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from mooncaked.bench import testnet
from mooncaked.bench.etcd_server import MISSING_REASON, etcd_binary
from mooncaked.config import load_config
from mooncaked.roles.base import PeerClients
from mooncaked.roles.worker.messages import PREFILL, PrefillReply, PrefillRequest, SamplingSpec
from mooncaked.sched.prefix_plans import prefix_plans
from mooncaked.sched.types import Placement, RequestInfo
from tests.roles.network_fleet import ETCD_HOST, FAST_MBIT, LEASE_TTL_S, SLOW_HOST, NetworkFleet
from tests.roles.test_conductor_flow import GREEDY, expected_text, prompt
from tests.roles.test_disagg_roles import keys_for

NUM_PROMPT_TOKENS = 968  # 60 whole blocks of 16 and 8 tokens more: every block is a reusable prefix block
NUM_BLOCKS = NUM_PROMPT_TOKENS // 16


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetworkFleet]:
    reason = testnet.unavailable_reason() or ("" if etcd_binary() else MISSING_REASON)
    if reason:
        pytest.skip(reason)
    started = NetworkFleet(tmp_path_factory.mktemp("netfaults")).up()
    try:
        yield started
    finally:
        started.down()
    assert started.net.run_id not in " ".join(testnet.list_namespaces())


def prefill(fleet: NetworkFleet, name: str, request: PrefillRequest, timeout_s: float = 20.0) -> PrefillReply:
    """PREFILL on instance `name`, called from its own host."""
    config = load_config(fleet.tmp_path / f"{name}.yaml")

    async def call() -> PrefillReply:
        clients = PeerClients(config, config.instance_named(name))
        try:
            reply = await clients.for_instance(config.instance_named(name)).call(PREFILL, request,
                                                                                   timeout_s=timeout_s)
            assert isinstance(reply, PrefillReply)
            return reply
        finally:
            await clients.close()

    return fleet.on(name, call, timeout_s + 5.0)


def prefill_request(fleet: NetworkFleet, request_id: str, tokens: list[int], **fetch: Any) -> PrefillRequest:
    keys = keys_for(load_config(fleet.tmp_path / "p0.yaml"), tokens)
    return PrefillRequest(request_id, tokens, keys, SamplingSpec(max_tokens=1, temperature=0.0), **fetch)


def complete(fleet: NetworkFleet, conductor: str, tokens: list[int], max_tokens: int,
             timeout_s: float = 15.0) -> dict[str, Any]:
    """A greedy completion through `conductor`, from its own host; its body (HTTP 200 asserted)."""
    async def post() -> dict[str, Any]:
        body = {"model": "tiny", "prompt": tokens, "max_tokens": max_tokens, **GREEDY}
        async with aiohttp.ClientSession() as http, http.post(f"{fleet.url(conductor)}/v1/completions",
                                                              json=body) as response:
            data: dict[str, Any] = await response.json()
            assert response.status == 200, data
            return data
    return fleet.on(conductor, post, timeout_s)


def test_a_nic_down_during_a_large_prefix_load_loses_nothing(fleet: NetworkFleet) -> None:
    tokens = prompt(2901, NUM_PROMPT_TOKENS)
    expected, _ = expected_text(tokens, 1)
    stored = prefill(fleet, "p1", prefill_request(fleet, "b-store", tokens))  # s1 (host 1) holds the 60 blocks
    assert stored.first_token.token_id == expected[0]
    result: dict[str, Any] = {}  # the load runs on host 0's loop; the test's thread pulls the cable meanwhile

    def load() -> None:
        started = time.monotonic()
        try:
            result["reply"] = prefill(fleet, "p0", prefill_request(fleet, "b-load", tokens, fetch_store="s1",
                                                                   num_fetch_blocks=NUM_BLOCKS))
        except Exception as exc:
            result["error"] = exc
        result["load_s"] = time.monotonic() - started

    engine, s1_endpoint = fleet.inner("p0").worker.engine, fleet.inner("s1").engine.endpoint
    path_samples: list[dict[str, bool]] = []

    async def watch_paths() -> None:
        while thread.is_alive():
            path_samples.append(engine.path_states(s1_endpoint))
            await asyncio.sleep(0.02)

    thread = threading.Thread(target=load)
    thread.start()
    watcher = threading.Thread(target=fleet.on, args=("p0", watch_paths, 30.0))
    watcher.start()
    try:
        time.sleep(0.3)  # the load is under way: 60 blocks over host 1's slow links take seconds
        fleet.net.set_link(SLOW_HOST, 1, False)
        thread.join(25.0)
    finally:
        fleet.net.set_link(SLOW_HOST, 1, True)
        watcher.join(10.0)
    assert not thread.is_alive() and "error" not in result, result
    # p0 moved the load over both NIC pairs to s1, and NIC 1's paths failed and cooled down during it
    assert any(any(not ok for path, ok in states.items() if "@nic1>" in path)
               and all(ok for path, ok in states.items() if "@nic0>" in path) for states in path_samples), \
        path_samples[-3:]
    reply = result["reply"]
    assert reply.num_fetched_blocks == NUM_BLOCKS and reply.num_cached_tokens == NUM_BLOCKS * 16
    assert reply.first_token.token_id == expected[0]
    assert result["load_s"] > 1.0, f"{result['load_s']:.2f}s: the cable was pulled after the load ended"
    # Whole blocks only: host 0's store took all 60 from the load; a prefill there reuses every one of them and
    # computes the same next token.
    again = prefill(fleet, "p0", prefill_request(fleet, "b-again", tokens))
    assert again.num_fetched_blocks == 0 and again.num_cached_tokens == NUM_BLOCKS * 16
    assert again.first_token.token_id == expected[0]
    fleet.wait_converged(LEASE_TTL_S + 5.0)  # host 1 reached etcd over NIC 1 too: its members are back


def test_a_slow_link_is_measured_and_its_prefix_recomputed(fleet: NetworkFleet) -> None:
    prompts = [prompt(seed, NUM_PROMPT_TOKENS) for seed in (2902, 2903)]
    for i, tokens in enumerate(prompts):  # only s1, behind the slow links, holds these prefixes
        prefill(fleet, "p1", prefill_request(fleet, f"c-store{i}", tokens))
    view = fleet.conductor("c0").view
    assert view is not None
    fleet.stop("p1")  # every prompt now goes to p0 on host 0: fetch over the slow link, or recompute
    try:
        fleet.wait("c0", lambda v: "p1" not in v.prefill or not v.prefill["p1"].is_placeable, 10.0, "p1 gone")
        fleet.wait("c0", lambda v: min(v.index.prefix_lengths(keys_for(load_config(fleet.tmp_path / "p0.yaml"),
                                                                        prompts[1])).values(), default=0) > 0,
                   5.0, "the index shows s1's blocks")
        _, text = expected_text(prompts[0], 2)
        assert complete(fleet, "c0", prompts[0], 2)["choices"][0]["text"] == text
        link_bytes_per_s = fleet.read("c0", lambda: view.predictors.current.transfer.bandwidth)
        ((store, measured),) = fleet.read("c0", lambda: view.fetch_rates.for_instance("p0"))
        fast_pair_bytes_per_s = 2 * FAST_MBIT * 1e6 / 8  # both NICs of two fast hosts
        assert store == "s1" and measured < 0.5 * fast_pair_bytes_per_s < link_bytes_per_s
        keys = keys_for(load_config(fleet.tmp_path / "p0.yaml"), prompts[1])
        info = RequestInfo("c-probe", NUM_PROMPT_TOKENS, tuple(keys), max_tokens=2)

        def placement_and_papers() -> tuple[Any, Any]:
            placed = view.placer.place(info, time.monotonic(), frozenset())
            policy = view.placer.policy()
            papers = prefix_plans(0, view.index.prefix_lengths(info.block_keys), {"s1": measured},
                                  policy.config.kvcache_balancing_threshold, policy.predictors.transfer)[0]
            return placed, papers

        placed, papers = fleet.read("c0", placement_and_papers)
        assert papers.source == "s1" and papers.num_prefix_blocks == NUM_BLOCKS  # line 5: fetch over the slow link
        assert isinstance(placed, Placement) and placed.prefill_instance == "p0"
        assert placed.fetch_from_store is None and placed.predicted_transfer_s == 0.0  # recompute instead
        assert placed.predicted_ttft_s < papers.transfer_s
        before = fleet.read("c0", lambda: dict(view.prefix_blocks))
        _, text = expected_text(prompts[1], 2)
        assert complete(fleet, "c0", prompts[1], 2)["choices"][0]["text"] == text
        after = fleet.read("c0", lambda: dict(view.prefix_blocks))
        assert after["reused_remote"] == before["reused_remote"] and after["computed"] > before["computed"]
    finally:
        fleet.start("p1")
        fleet.wait_converged(15.0)


def test_etcd_cut_off_from_the_leader_moves_leadership_without_overlap(fleet: NetworkFleet) -> None:
    leaders = {name: fleet.read(name, partial(lambda c: fleet.controller(c).membership.leader(), name))
               for name in ("c0", "c1")}
    leader = leaders["c0"]
    assert leader in ("c0", "c1") and leaders["c1"] == leader
    follower = "c1" if leader == "c0" else "c0"
    leader_host = fleet.host_of(leader).host
    assert leader_host != ETCD_HOST
    samples: dict[str, list[tuple[float, bool, bool]]] = {leader: [], follower: []}
    is_sampling = threading.Event()
    is_sampling.set()

    async def sample(name: str) -> None:
        controller = fleet.controller(name)
        while is_sampling.is_set():
            samples[name].append((time.monotonic(), controller.membership.is_leader(), controller.is_leading))
            await asyncio.sleep(0.02)

    samplers = [threading.Thread(target=fleet.on, args=(name, partial(sample, name), 60.0))
                for name in (leader, follower)]
    for thread in samplers:
        thread.start()
    tokens = prompt(2904, 64)
    _, text = expected_text(tokens, 2)
    try:
        cut_at = time.monotonic()
        fleet.net.set_link(leader_host, 1, False)  # the leader's rail-1 link: etcd only
        for name in (leader, follower):  # placement needs no lease: both conductors keep serving
            assert complete(fleet, name, tokens, 2, timeout_s=10.0)["choices"][0]["text"] == text
        fleet.wait(follower, lambda v: fleet.controller(follower).membership.is_leader(),
                   LEASE_TTL_S + 4.0, f"{follower} leads")
        fleet.wait(follower, lambda v: fleet.controller(follower).is_leading, 3.0, "its controller leads")
        takeover_s = time.monotonic() - cut_at
    finally:
        fleet.net.set_link(leader_host, 1, True)
    healed_at = time.monotonic()
    fleet.wait(leader, lambda v: fleet.controller(leader).membership.is_connected
               and fleet.controller(leader).membership.leader() == follower, LEASE_TTL_S + 3.0,
               f"{leader} back on etcd, following {follower}")
    fleet.wait_converged(LEASE_TTL_S + 3.0)
    converged_s = time.monotonic() - healed_at
    is_sampling.clear()
    for thread in samplers:
        thread.join(5.0)
    last_led = max((t for t, is_leader, is_leading in samples[leader] if is_leader or is_leading), default=0.0)
    first_led = min(t for t, is_leader, is_leading in samples[follower] if is_leader or is_leading)
    assert last_led < first_led, "two conductors led at once"
    assert last_led - cut_at <= LEASE_TTL_S + 0.5, f"{leader} led {last_led - cut_at:.1f}s after the cut"
    assert takeover_s <= LEASE_TTL_S + 4.0 and converged_s <= LEASE_TTL_S + 3.0, (takeover_s, converged_s)
