"""StoreFollower against a real store: dump, events, a lost event window, an unreachable store."""

from __future__ import annotations

import asyncio
from pathlib import Path

from mooncaked.config import Config
from mooncaked.roles.base import PeerClients
from mooncaked.roles.conductor.view.store_follower import FollowerSettings, StoreFollower
from mooncaked.roles.store import StoreRole
from mooncaked.sched.shadow_index import ShadowIndex
from mooncaked.store.client import StoreClient
from mooncaked.store.shm_pool import pool_path
from tests.roles.cluster_fixtures import cluster_config, instance

BLOCK_BYTES = 4096
FAST = FollowerSettings(events_renew_s=2.0, dump_timeout_s=5.0, min_backoff_s=0.05, max_backoff_s=0.2)


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def make_config(tmp_path: Path) -> Config:
    return cluster_config(tmp_path, [instance("s0", "store"), instance("c0", "conductor")],
                          store={"dram_bytes": 1 << 20, "max_events_buffered": 16},
                          rpc={"connect_timeout_s": 0.3})


def make_follower(config: Config, peers: PeerClients) -> StoreFollower:
    store = config.instance_named("s0")
    index = ShadowIndex()
    index.add_store(store.name)
    return StoreFollower(store, peers.for_instance(store), index, FAST)


async def put(client: StoreClient, keys: list[bytes]) -> None:
    reply = await client.allocate(keys, BLOCK_BYTES, lease_ms=5000)
    await client.commit([h.handle_id for h in reply.handles])


async def test_follower_dumps_again_when_its_event_window_is_gone(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    store = StoreRole(config, config.instance_named("s0"))
    await store.start()
    peers = PeerClients(config, config.instance_named("c0"))
    follower = make_follower(config, peers)
    index = follower.index
    client = await StoreClient.connect(follower.client, host=follower.store.host, timeout_s=5.0,
                                       pool_path=pool_path(config.cluster.id, follower.store.name,
                                                           config.store.shm_dir))
    try:
        await put(client, [key(0)])
        await follower.sync_step(events_s=0.1)
        assert follower.num_resyncs == 1 and index.prefix_lengths([key(0)]) == {"s0": 1}
        await put(client, [key(i) for i in range(1, 41)])  # 40 events; the store keeps the newest 16
        await follower.sync_step(events_s=0.2)
        assert follower.needs_dump
        await follower.sync_step(events_s=0.1)
        assert follower.num_resyncs == 2 and not follower.needs_dump
        assert index.prefix_lengths([key(i) for i in range(41)]) == {"s0": 41}
        await put(client, [key(41)])
        await follower.sync_step(events_s=0.2)
        assert index.prefix_lengths([key(i) for i in range(42)]) == {"s0": 42}
    finally:
        await client.close()
        await peers.close()
        await store.stop()


async def test_an_unreachable_store_serves_no_prefix_until_it_answers(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    peers = PeerClients(config, config.instance_named("c0"))
    follower = make_follower(config, peers)
    follower.index.apply_dump("s0", 3, [key(0), key(1)])  # what the store held before it went away
    task = asyncio.create_task(follower.run())
    store = StoreRole(config, config.instance_named("s0"))
    try:
        await asyncio.wait_for(follower.has_tried.wait(), 3.0)
        assert not follower.is_up and follower.needs_dump and follower.last_error
        assert follower.index.prefix_lengths([key(0), key(1)]) == {}
        await store.start()
        async with asyncio.timeout(3.0):
            while not follower.is_up:
                await asyncio.sleep(0.02)
        assert follower.num_resyncs == 1 and follower.last_error == ""
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await store.stop()
        await peers.close()
