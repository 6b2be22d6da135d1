"""ClusterView against real stores: dump at start, events, a store restart; placement over its own state."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from mooncaked.config import Config, PrefillGroupConfig
from mooncaked.model.loader import load_model
from mooncaked.roles.base import PeerClients
from mooncaked.roles.conductor.role import default_predictors, policy_config
from mooncaked.roles.conductor.view.cluster import ClusterView, ClusterViewSettings
from mooncaked.roles.conductor.view.cluster_info import describe_cluster
from mooncaked.roles.conductor.view.predictors import LivePredictors
from mooncaked.roles.conductor.view.store_follower import FollowerSettings
from mooncaked.roles.store import StoreRole
from mooncaked.roles.worker.messages import LoadReply
from mooncaked.sched.types import REASON_DECODE_FULL, REASON_NO_DECODE, Placement, Rejection, RequestInfo
from mooncaked.store.client import StoreClient
from mooncaked.store.shm_pool import pool_path
from tests.roles.cluster_fixtures import cluster_config, instance

BLOCK_BYTES = 4096
FAST = ClusterViewSettings(poll_interval_s=0.05, poll_timeout_s=0.5, startup_timeout_s=3.0,
                           follower=FollowerSettings(events_renew_s=2.0, dump_timeout_s=5.0, min_backoff_s=0.05,
                                                     max_backoff_s=0.2))


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def make_config(tmp_path: Path, *extra: dict[str, object], num_stores: int = 2) -> Config:
    stores = [instance("s0", "store"), instance("s1", "store", host="127.0.0.2")][:num_stores]
    return cluster_config(tmp_path, [*stores, instance("c0", "conductor"), *extra],
                          store={"dram_bytes": 1 << 20, "max_events_buffered": 16})


def make_view(config: Config, peers: PeerClients) -> ClusterView:
    loaded = load_model(config.model.source, dtype=config.model.dtype, seed=config.model.seed)
    return ClusterView(config, peers, policy_config(config), LivePredictors(default_predictors(config, loaded)),
                       FAST)


@contextlib.asynccontextmanager
async def store_client(config: Config, peers: PeerClients, name: str) -> AsyncIterator[StoreClient]:
    store = config.instance_named(name)
    client = await StoreClient.connect(peers.for_instance(store), host=store.host, timeout_s=5.0,
                                       pool_path=pool_path(config.cluster.id, name, config.store.shm_dir))
    try:
        yield client
    finally:
        await client.close()


async def put(client: StoreClient, keys: list[bytes]) -> None:
    reply = await client.allocate(keys, BLOCK_BYTES, lease_ms=5000)
    await client.commit([h.handle_id for h in reply.handles])


async def eventually(condition: Callable[[], bool], timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_index_is_dumped_at_start_then_follows_events(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    stores = [StoreRole(config, config.instance_named(name)) for name in ("s0", "s1")]
    for store in stores:
        await store.start()
    peers = PeerClients(config, config.instance_named("c0"))
    view = make_view(config, peers)
    try:
        async with store_client(config, peers, "s0") as s0, store_client(config, peers, "s1") as s1:
            await put(s0, [key(i) for i in range(6)])
            await view.start()  # the first request after start must already see these
            assert view.index.prefix_lengths([key(i) for i in range(8)]) == {"s0": 6}
            await put(s1, [key(i) for i in range(3)])
            await put(s0, [key(6), key(7)])
            await eventually(lambda: view.index.prefix_lengths([key(i) for i in range(8)]) == {"s0": 8, "s1": 3})
            assert view.followers["s0"].num_resyncs == 1 and view.followers["s1"].num_resyncs == 1
            # 1 MiB of 4 KiB blocks: pushing 300 more evicts (BlockRemoved events) down to the low watermark
            for start in range(1000, 1300, 20):
                await put(s1, [key(start + i) for i in range(20)])
            _, present = await s1.dump()
            await eventually(lambda: view.index.num_blocks("s1") == len(present))
            assert all(view.index.holders(k) == ["s1"] for k in present if k not in {key(i) for i in range(8)})
            info = await describe_cluster(view)
            assert {s["name"]: s["num_indexed_blocks"] for s in info["stores"]} == {"s0": 8, "s1": len(present)}
            assert info["stores"][0]["stats"] is not None and info["index"]["stale_stores"] == []
    finally:
        await view.stop()
        await peers.close()
        for store in stores:
            await store.stop()


async def test_a_restarted_store_is_dumped_afresh(tmp_path: Path) -> None:
    config = make_config(tmp_path, num_stores=1)
    store = StoreRole(config, config.instance_named("s0"))
    await store.start()
    peers = PeerClients(config, config.instance_named("c0"))
    view = make_view(config, peers)
    try:
        async with store_client(config, peers, "s0") as client:
            await put(client, [key(i) for i in range(4)])
        await view.start()
        assert view.index.prefix_lengths([key(0)]) == {"s0": 1}
        await store.stop()
        await eventually(lambda: not view.followers["s0"].is_up)
        assert view.index.prefix_lengths([key(0)]) == {}  # an unreachable store serves no prefix
        store = StoreRole(config, config.instance_named("s0"))
        await store.start()
        async with store_client(config, peers, "s0") as client:
            await put(client, [key(100)])
        await eventually(lambda: view.index.prefix_lengths([key(100)]) == {"s0": 1})
        assert view.index.prefix_lengths([key(0)]) == {} and view.followers["s0"].num_resyncs >= 2
    finally:
        await view.stop()
        await peers.close()
        await store.stop()


def idle_load(num_running: int = 0) -> LoadReply:
    return LoadReply(role="decode", num_running=num_running, num_waiting=0, num_queued_tokens=0,
                     num_free_pages=256, num_pages=256, step_time_s=0.0)


async def test_placement_queue_model_inline_and_rejections(tmp_path: Path) -> None:
    """Placement over the view's own state (no network): the queue model, inline prefill, decode room."""
    config = make_config(tmp_path, instance("p0", "prefill"), instance("p1", "prefill"),
                         instance("d0", "decode", settings={"max_batch_size": 2, "inline_prefill_max_tokens": 8}))
    peers = PeerClients(config, config.instance_named("c0"))
    view = make_view(config, peers)
    request = RequestInfo("r0", 100, tuple(key(i) for i in range(6)))
    assert isinstance(view.place(request, 0.0), Rejection)  # nothing polled yet: every worker is down
    for worker in view.workers:
        worker.is_up, worker.load = True, idle_load()
    first = view.place(request, 0.0)
    assert isinstance(first, Placement) and first.prefill_instance == "p0" and first.predicted_queue_s == 0.0
    view.flights.begin(request, first, 0.0)
    second = view.place(RequestInfo("r1", 100, request.block_keys), 0.0)
    assert isinstance(second, Placement) and second.prefill_instance == "p1"  # p0 is busy with r0
    view.flights.prefill_done("r0")
    view.flights.begin(RequestInfo("r1", 100, request.block_keys), second, 0.0)
    full = view.place(RequestInfo("r2", 100, request.block_keys), 0.0)
    assert isinstance(full, Rejection) and full.reason == REASON_DECODE_FULL  # 2 placed on d0, max_batch_size 2
    view.flights.finish("r0")
    short = view.place(RequestInfo("r3", 5, ()), 0.0)
    assert isinstance(short, Placement) and short.prefill_instance == ""  # 5 uncached tokens <= 8: inline
    view.health.report_failure("d0", "test")
    gone = view.place(RequestInfo("r4", 100, request.block_keys), 0.0)
    assert isinstance(gone, Rejection) and gone.reason == REASON_NO_DECODE
    await peers.close()


async def test_placement_prefers_the_instance_whose_device_tier_holds_the_prefix(tmp_path: Path) -> None:
    """LOAD replies' device-cache reports (a dump, then changes) feed the device index placement reads: of two
    idle prefill instances, the one holding the prompt's prefix in its pages wins, until it reports them lost."""
    config = make_config(tmp_path, instance("p0", "prefill"), instance("p1", "prefill"),
                         instance("d0", "decode", settings={"inline_prefill_max_tokens": 0}))
    peers = PeerClients(config, config.instance_named("c0"))
    view = make_view(config, peers)
    keys = [key(i) for i in range(6)]
    request = RequestInfo("r0", 100, tuple(keys))
    for worker in view.workers:
        worker.is_up, worker.load = True, idle_load()
    first = view.place(request, 0.0)
    assert isinstance(first, Placement) and first.prefill_instance == "p0"  # a tie: the first
    p1 = view.prefill["p1"]
    assert view.device_index.last_seq("p1") == -1  # the next poll asks for a dump
    view.health.loaded(p1, dataclasses.replace(idle_load(), device_cache_seq=3, device_keys_gained=keys[:4],
                                         is_device_cache_dump=True), -1)
    placed = view.place(RequestInfo("r1", 100, tuple(keys)), 0.0)
    assert isinstance(placed, Placement) and placed.prefill_instance == "p1" and placed.num_local_prefix_blocks == 4
    view.health.loaded(p1, dataclasses.replace(idle_load(), device_cache_seq=5, device_keys_lost=keys[:1]), 3)
    assert view.device_index.last_seq("p1") == 5
    again = view.place(RequestInfo("r2", 100, tuple(keys)), 0.0)
    assert isinstance(again, Placement) and again.prefill_instance == "p0"  # block 0 gone: no prefix left
    view.health.loaded(p1, dataclasses.replace(idle_load(), device_cache_seq=9, device_keys_gained=keys[:1]), 7)
    assert view.device_index.last_seq("p1") == -1  # a gap (7 is not 5): a dump next time
    await peers.close()


async def test_copies_on_other_stores_become_spare_and_go_first(tmp_path: Path) -> None:
    """Replication by_reuse end to end: s1 serves a placement of blocks s0 holds too; the conductor's background
    marks make s0 give its copies back before its own older blocks, with no call on the request path."""
    config = make_config(tmp_path, instance("p1", "prefill", host="127.0.0.2"),
                         instance("d1", "decode", host="127.0.0.2", settings={"inline_prefill_max_tokens": 0}))
    stores = {name: StoreRole(config, config.instance_named(name)) for name in ("s0", "s1")}
    for store in stores.values():
        await store.start()
    peers = PeerClients(config, config.instance_named("c0"))
    loaded = load_model(config.model.source, dtype=config.model.dtype, seed=config.model.seed)
    settings = dataclasses.replace(FAST, spare_marks_interval_s=0.05)
    view = ClusterView(config, peers, policy_config(config), LivePredictors(default_predictors(config, loaded)),
                       settings)
    shared = [key(i) for i in range(4)]
    try:
        async with store_client(config, peers, "s0") as s0, store_client(config, peers, "s1") as s1:
            await put(s0, [key(100 + i) for i in range(40)])  # s0's own blocks, older than the shared ones
            await put(s0, shared)
            await put(s1, shared)
            await view.start()
            await eventually(lambda: view.index.prefix_lengths(shared) == {"s0": 4, "s1": 4})
            for worker in view.workers:  # no worker process runs here: they answer no poll
                worker.is_up, worker.load = True, idle_load()
            placement = view.place(RequestInfo("r0", 4 * 16 + 1, tuple(shared)), time.monotonic())
            assert isinstance(placement, Placement) and placement.prefill_instance == "p1"
            assert placement.num_local_prefix_blocks == 4  # p1 reuses them on s1: s0's copies become spare
            await eventually(lambda: stores["s0"].service.core.stats()["num_spare_blocks"] == 4)
            assert stores["s1"].service.core.stats()["num_spare_blocks"] == 0
            # 1 MiB of 4 KiB blocks: 244 blocks pass the high watermark (95%) and maintenance evicts 27, down to
            # 85%: the 4 spare copies and the 23 oldest of s0's own blocks (least recently used first would have
            # taken 27 of its own and kept the shared ones)
            for start in range(1000, 1200, 20):
                await put(s0, [key(start + i) for i in range(20)])
            await eventually(lambda: stores["s0"].service.core.stats()["num_evicted"] == 27)
            assert not (await s0.lookup(shared)).locations
            for i in range(23, 40):
                assert (await s0.lookup([key(100 + i)])).locations, i
            assert not (await s0.lookup([key(122)])).locations
            assert (await s1.lookup(shared)).locations and view.spare_marks.num_failed_calls == 0
    finally:
        await view.stop()
        await peers.close()
        for store in stores.values():
            await store.stop()


async def test_a_prefill_group_is_one_candidate_while_every_member_is_up(tmp_path: Path) -> None:
    """g0 + g1 form a group whose first stage reports a pipeline twice as fast as the single instance p0."""
    config = make_config(tmp_path, instance("p0", "prefill"), instance("g0", "prefill"), instance("g1", "prefill"),
                         instance("d0", "decode", settings={"inline_prefill_max_tokens": 0}))
    config = dataclasses.replace(config, cluster=dataclasses.replace(
        config.cluster, prefill_groups=[PrefillGroupConfig("pg", ["g0", "g1"])]), scheduler=dataclasses.replace(
        config.scheduler, cpp_min_tokens=1000))
    peers = PeerClients(config, config.instance_named("c0"))
    view = make_view(config, peers)
    single = (0.0, 1.0, -1.0, 0.0, 0.0, 0.0)  # 1 s per 1000 tokens
    half = (0.0, 0.5, -0.5, 0.0, 0.0, 0.0)
    for worker in view.workers:
        worker.is_up, worker.load = True, idle_load()
    view.prefill["p0"].load = dataclasses.replace(idle_load(), prefill_coefficients=list(single))
    view.predictors.report("p0", list(single), [])
    assert view.is_group_ready("g0")  # no pipeline reported yet: the default model over the stages
    view.prefill["g0"].load = dataclasses.replace(idle_load(), stage_coefficients=list(half),
                                                  pipeline_stages=[list(half), list(half)], cpp_chunk_tokens=500,
                                                  pipeline_handoffs_s=[0.01])
    long = view.place(RequestInfo("r0", 3000, ()), 0.0)
    assert isinstance(long, Placement) and long.prefill_instance == "g0"
    assert long.predicted_prefill_s < 2.0  # 6 chunks of 0.25 s, one more for the drain: 1.76 s, not 3 s
    short = view.place(RequestInfo("r1", 900, ()), 0.0)
    assert isinstance(short, Placement) and short.prefill_instance == "p0"  # not over cpp_min_tokens
    assert all(view.place(RequestInfo(f"x{i}", 3000, ()), 0.0).prefill_instance != "g1" for i in range(3))
    view.health.report_failure("g1", "killed")  # a member down: the group takes nothing until it is back
    assert not view.is_group_ready("g0")
    fallback = view.place(RequestInfo("r2", 3000, ()), 0.0)
    assert isinstance(fallback, Placement) and fallback.prefill_instance == "p0"
    view.prefill["g1"].is_up = True
    again = view.place(RequestInfo("r3", 3000, ()), 0.0)
    assert isinstance(again, Placement) and again.prefill_instance == "g0"
    excluded = view.place(RequestInfo("r4", 3000, ()), 0.0, excluded=frozenset({"g0"}))
    assert isinstance(excluded, Placement) and excluded.prefill_instance == "p0"
    info = await describe_cluster(view)
    assert info["prefill_groups"] == [{"name": "pg", "members": ["g0", "g1"], "is_ready": True}]
    assert view.predictors.prefill_for("p0").coefficients == single  # stage models never become the default
    await peers.close()
