"""The conductor's spare-mark sender against a real store over RPC: chunked calls, and resending after failures."""

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from mooncaked.roles.conductor.view.spare_marks import SpareMarkSender
from mooncaked.rpc import RpcClient, RpcServer
from mooncaked.sched.replicas import BlockCosts, ReplicaTracker
from mooncaked.sched.shadow_index import ShadowIndex
from mooncaked.sched.types import PolicyConfig
from mooncaked.store.service import StoreService, StoreServiceConfig
from tests.roles.cluster_fixtures import free_port

COSTS = BlockCosts(transfer_s=0.002, recompute_s=0.07)
KEYS = [i.to_bytes(16, "little") for i in range(5)]


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[tuple[StoreService, str]]:
    service = StoreService(StoreServiceConfig(pool_path=str(tmp_path / "pool"), dram_bytes=64 * 4096,
                                              host="127.0.0.1"), engine=None)
    await service.start()
    server = RpcServer(role="store", instance="s0", cluster_id="test", secret=None)
    service.add_methods(server)
    port = await server.start_tcp("127.0.0.1", 0)
    yield service, f"tcp://127.0.0.1:{port}"
    await server.stop(1.0)
    await service.stop()


def _client(address: str) -> RpcClient:
    return RpcClient(address, role="conductor", instance="c0", cluster_id="test", secret=None)


def _tracker_with_spares() -> ReplicaTracker:
    """s0 and s1 both hold KEYS; a placement on s1 used them: s0's copies are spare."""
    index = ShadowIndex()
    index.apply_dump("s0", 0, KEYS)
    index.apply_dump("s1", 0, KEYS)
    tracker = ReplicaTracker(PolicyConfig(replication="by_reuse"), index)
    tracker.note_use("s1", KEYS, 0, now=0.0)
    return tracker


def _put_all(service: StoreService) -> None:
    grants, _, _ = service.core.allocate(KEYS, 4096, 10_000, 0.0)
    service.core.commit([g.handle_id for g in grants], 0.0)


async def test_marks_reach_the_store_in_chunks(store: tuple[StoreService, str]) -> None:
    service, address = store
    _put_all(service)
    client = _client(address)
    sender = SpareMarkSender(_tracker_with_spares(), lambda name: client if name == "s0" else None,
                             lambda: COSTS, lambda: 1.0, interval_s=0.05, timeout_s=2.0, max_keys_per_call=2)
    try:
        await sender.send_once()
    finally:
        await client.close()
    assert service.core.stats()["num_spare_blocks"] == 5
    assert sender.num_marks_sent == 5 and sender.num_failed_calls == 0


async def test_undelivered_marks_are_sent_again(store: tuple[StoreService, str]) -> None:
    service, address = store
    _put_all(service)
    dead = _client(f"tcp://127.0.0.1:{free_port()}")  # nothing listens there
    live = _client(address)
    clients = {"s0": dead}
    sender = SpareMarkSender(_tracker_with_spares(), clients.get, lambda: COSTS, lambda: 1.0,
                             interval_s=0.05, timeout_s=1.0)
    try:
        await sender.send_once()
        assert sender.num_failed_calls == 1 and service.core.stats()["num_spare_blocks"] == 0
        clients["s0"] = live
        await sender.send_once()
    finally:
        await dead.close()
        await live.close()
    assert service.core.stats()["num_spare_blocks"] == 5 and sender.num_marks_sent == 5
