"""RDMA transport logic against the fake verbs layer: topology path choice, slicing, failover, endpoint pool."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import numpy as np
import pytest

from mooncaked.transfer import SegmentRef, Topology, TransferEngine, TransferError, TransferOp, TransferRequest
from tests.transfer.fake_verbs import FakeFabric

MIB = 1 << 20
SLICE = 64 << 10
A, B = "127.0.0.1", "127.0.0.2"
TOPOLOGY_A = Topology.from_config({"cpu:0": [["a0"], ["a1"]], "cpu:1": [["a1"], ["a0"]]})
TOPOLOGY_B = Topology.from_config({"cpu:0": [["b0"], ["b1"]], "cpu:1": [["b1"], ["b0"]]})

EngineFactory = Callable[..., TransferEngine]


@pytest.fixture
async def make_engine() -> AsyncIterator[EngineFactory]:
    engines: list[TransferEngine] = []

    def make(host: str, fabric: FakeFabric | None, topology: Topology | None, **options: object) -> TransferEngine:
        transports = ("local", "rdma", "tcp") if fabric is not None else ("local", "tcp")
        verbs = fabric.provider(host) if fabric is not None else None
        engine = TransferEngine(
            host=host, transports=transports, verbs=verbs, topology=topology, slice_bytes=SLICE,
            **options,  # type: ignore[arg-type]
        )
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        await engine.stop()


async def write_and_check(a: TransferEngine, ref: SegmentRef, dst: np.ndarray, num_bytes: int, seed: int) -> None:
    src = np.random.default_rng(seed).integers(0, 256, num_bytes, dtype=np.uint8)
    name = f"src{seed}"
    a.register(name, src, "cpu:1")
    await a.wait(a.submit([TransferRequest(TransferOp.WRITE, name, 0, ref, 0, num_bytes)]), timeout_s=10)
    assert np.array_equal(dst[:num_bytes], src)
    back = np.zeros(num_bytes, np.uint8)
    a.register(f"back{seed}", back, "cpu:1")
    await a.wait(a.submit([TransferRequest(TransferOp.READ, f"back{seed}", 0, ref, 0, num_bytes)]), timeout_s=10)
    assert np.array_equal(back, src)


async def test_preferred_nic_pair_and_slicing(make_engine: EngineFactory) -> None:
    fabric = FakeFabric({A: ["a0", "a1"], B: ["b0", "b1"]})
    a, b = make_engine(A, fabric, TOPOLOGY_A), make_engine(B, fabric, TOPOLOGY_B)
    await a.start()
    await b.start()
    assert a.rdma is not None and b.rdma is not None
    dst = np.zeros(4 * MIB + 123, np.uint8)
    ref = b.register("dst", dst, "cpu:0")
    await write_and_check(a, ref, dst, 4 * MIB + 123, seed=1)
    assert set(fabric.bytes_by_pair) == {("a1", "b0")}, "cpu:1 on A prefers a1; cpu:0 on B prefers b0"
    assert fabric.bytes_by_pair[("a1", "b0")] == 2 * (4 * MIB + 123)
    assert max(fabric.wr_lengths) == SLICE and fabric.wr_lengths.count(123) == 2
    assert len(fabric.wr_lengths) == 2 * (4 * MIB // SLICE + 1)


async def test_nic_down_fails_over_to_secondary_then_recovers(make_engine: EngineFactory) -> None:
    fabric = FakeFabric({A: ["a0", "a1"], B: ["b0", "b1"]})
    a = make_engine(A, fabric, TOPOLOGY_A, path_cooldown_s=0.3, path_failure_threshold=1)
    b = make_engine(B, fabric, TOPOLOGY_B)
    await a.start()
    await b.start()
    dst = np.zeros(MIB, np.uint8)
    ref = b.register("dst", dst, "cpu:0")
    await write_and_check(a, ref, dst, MIB, seed=1)
    fabric.set_down(A, "a1")
    fabric.bytes_by_pair.clear()
    await write_and_check(a, ref, dst, MIB, seed=2)
    assert fabric.bytes_by_pair[("a0", "b0")] == 2 * MIB, "failed over to the secondary local NIC"
    assert ("a1", "b0") not in fabric.bytes_by_pair
    fabric.set_down(A, "a1", is_down=False)
    await asyncio.sleep(0.35)
    fabric.bytes_by_pair.clear()
    await write_and_check(a, ref, dst, MIB, seed=3)
    assert set(fabric.bytes_by_pair) == {("a1", "b0")}, "back on the preferred pair after the cooldown"


async def test_broken_queue_pair_is_removed_and_rebuilt(make_engine: EngineFactory) -> None:
    fabric = FakeFabric({A: ["a0"], B: ["b0"]})
    single = Topology.from_config({"cpu:0": [["a0"], []], "cpu:1": [["a0"], []]})
    a = make_engine(A, fabric, single, path_failure_threshold=3)
    b = make_engine(B, fabric, Topology.from_config({"cpu:0": [["b0"], []]}))
    await a.start()
    await b.start()
    dst = np.zeros(2 * MIB, np.uint8)
    ref = b.register("dst", dst, "cpu:0")
    await write_and_check(a, ref, dst, 2 * MIB, seed=1)
    assert a.rdma is not None and a.rdma.pool.num_connects == 1
    assert fabric.break_qps(A, "a0") == 1
    await write_and_check(a, ref, dst, 2 * MIB, seed=2)
    assert a.rdma.pool.num_connects == 2, "the broken queue pair was rebuilt on the next use"
    assert len([qp for qp in fabric.live_qps() if qp.nic.name == "a0"]) == 1, "the broken one was closed"


async def test_endpoint_pool_cap_evicts_and_disconnects_the_peer(make_engine: EngineFactory) -> None:
    hosts = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    fabric = FakeFabric({A: ["a0"], **{host: ["n0"] for host in hosts}})
    a = make_engine(A, fabric, Topology.from_config({"cpu:0": [["a0"], []], "cpu:1": [["a0"], []]}), max_endpoints=2)
    await a.start()
    peers = [make_engine(host, fabric, Topology.from_config({"cpu:0": [["n0"], []]})) for host in hosts]
    refs, sinks = [], []
    for peer in peers:
        await peer.start()
        sinks.append(np.zeros(MIB, np.uint8))
        refs.append(peer.register("dst", sinks[-1], "cpu:0"))
    for index in (0, 1, 2, 0):
        await write_and_check(a, refs[index], sinks[index], MIB, seed=10 + len(fabric.wr_lengths))
    assert a.rdma is not None and len(a.rdma.pool) <= 2
    assert a.rdma.pool.num_connects == 4, "peer 0 was evicted (SIEVE) and reconnected"
    num_passive = [len(peer.rdma.pool) for peer in peers if peer.rdma is not None]
    assert sum(num_passive) <= 2, "evicted endpoints were disconnected on the peer's side too"


async def test_remote_errors_and_tcp_fallback(make_engine: EngineFactory) -> None:
    fabric = FakeFabric({A: ["a0", "a1"], B: ["b0", "b1"]})
    a, b = make_engine(A, fabric, TOPOLOGY_A), make_engine(B, fabric, TOPOLOGY_B)
    plain = make_engine("127.0.0.5", None, None)
    for engine in (a, b, plain):
        await engine.start()
    a.register("src", np.ones(MIB, np.uint8))
    ref = b.register("dst", np.zeros(100, np.uint8))
    batch = a.submit([TransferRequest(TransferOp.WRITE, "src", 0, ref, 50, 100)])
    with pytest.raises(TransferError, match=r"range \[50, 150\) is outside segment 'dst' of 100 bytes"):
        await a.wait(batch, timeout_s=5)
    batch = a.submit([TransferRequest(TransferOp.WRITE, "src", 0, SegmentRef(b.endpoint, "nope"), 0, 10)])
    with pytest.raises(TransferError, match="segment 'nope' is not registered at 127.0.0.2"):
        await a.wait(batch, timeout_s=5)
    assert plain.rdma is None and "rdma is not in transports" in plain.rdma_unavailable_reason
    sink = np.zeros(MIB, np.uint8)
    plain_ref = plain.register("dst", sink)
    await a.wait(a.submit([TransferRequest(TransferOp.WRITE, "src", 0, plain_ref, 0, MIB)]), timeout_s=5)
    assert sink.all(), "a peer without RDMA NICs is reached over tcp"


async def test_rdma_unavailable_is_reported_with_the_reason(make_engine: EngineFactory, tmp_path: object) -> None:
    engine = TransferEngine(host=A, transports=("rdma", "tcp"), sysfs_root=str(tmp_path))
    await engine.start()
    try:
        assert engine.rdma is None
        assert engine.rdma_unavailable_reason  # pyverbs missing, or no NICs under the empty sysfs root
    finally:
        await engine.stop()


async def test_peer_re_registering_a_segment_is_described_again(make_engine: EngineFactory) -> None:
    fabric = FakeFabric({A: ["a0", "a1"], B: ["b0", "b1"]})
    a, b = make_engine(A, fabric, TOPOLOGY_A), make_engine(B, fabric, TOPOLOGY_B)
    await a.start()
    await b.start()
    first = np.zeros(MIB, np.uint8)
    ref = b.register("dst", first, "cpu:0")
    await write_and_check(a, ref, first, MIB, seed=1)
    b.unregister("dst")
    second = np.zeros(2 * MIB, np.uint8)
    b.register("dst", second, "cpu:0")  # new memory, new keys, same name
    await write_and_check(a, ref, second, 2 * MIB, seed=2)
    assert np.array_equal(first, np.random.default_rng(1).integers(0, 256, MIB, dtype=np.uint8)), "old memory untouched"
