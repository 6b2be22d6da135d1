"""Memory placement picks the NICs: a two-socket host with four NICs and eight GPUs (fake sysfs), store pools
registered at their NUMA node, GPU KV pages at "cuda:N" (GPUDirect where the fake NICs can map GPU memory),
pinned staging at the GPU's node; bytes are counted per NIC pair by the fake verbs layer."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from mooncaked.roles.store import pool_numa_node
from mooncaked.roles.worker.kv.placement import register_kv_pages, staging_placement
from mooncaked.runtime.numa import allowed_memory_nodes
from mooncaked.store.service import StoreService, StoreServiceConfig
from mooncaked.transfer import SegmentRef, TransferEngine, TransferOp, TransferRequest
from mooncaked.transfer.topology import NicTiers, Topology, discover_topology, gpu_numa_node, nic_numa_node
from tests.transfer.fake_verbs import FakeFabric
from tests.transfer.test_rdma_transport import EngineFactory, make_engine  # noqa: F401 (fixture)
from tests.transfer.test_topology import add_nic, add_pci_device

WORKER, STORE = "127.0.0.1", "127.0.0.2"
NICS = ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
NVIDIA_3D = ("0x030200", "0x10de")
NUM_BYTES = 1 << 20


def build_two_socket_host(root: Path) -> Path:
    """Two sockets; per socket two PCIe switches, each with one NIC and two GPUs (GPU 2k, 2k+1 share NIC k)."""
    for node in (0, 1):
        (root / "devices" / "system" / "node" / f"node{node}").mkdir(parents=True, exist_ok=True)
    for switch in range(4):
        node, bus = switch // 2, 0x80 * (switch // 2) + 2 * (switch % 2)
        below = f"pci0000:{bus & 0x80:02x}/0000:{bus & 0x80:02x}:{switch % 2 + 1:02x}.0/0000:{bus + 1:02x}:00.0"
        add_nic(root, NICS[switch], f"{below}/0000:{bus + 2:02x}:00.0", node)
        for gpu in (1, 2):
            add_pci_device(root, f"{below}/0000:{bus + 2:02x}:{gpu:02x}.0", node, *NVIDIA_3D)
    return root


@pytest.fixture
def two_socket_host(tmp_path: Path) -> Path:
    return build_two_socket_host(tmp_path / "sys")


def test_the_matrix_of_four_nics_and_eight_gpus(two_socket_host: Path) -> None:
    topology = discover_topology(two_socket_host)
    assert topology.matrix["cpu:0"] == NicTiers(("mlx5_0", "mlx5_1"), ("mlx5_2", "mlx5_3"))
    assert topology.matrix["cpu:1"] == NicTiers(("mlx5_2", "mlx5_3"), ("mlx5_0", "mlx5_1"))
    for gpu in range(8):
        assert topology.matrix[f"cuda:{gpu}"].preferred == (NICS[gpu // 2],), f"cuda:{gpu} shares a switch"
    assert nic_numa_node(two_socket_host) == 0
    assert [gpu_numa_node(i, two_socket_host) for i in range(9)] == [0, 0, 0, 0, 1, 1, 1, 1, None]


def test_where_a_store_binds_its_pool(two_socket_host: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert pool_numa_node(1, nic_numa_node(two_socket_host), {0}) == 1  # configured: checked when the pool is made
    assert pool_numa_node(None, nic_numa_node(two_socket_host), {0, 1}) == 0  # the NIC's node
    assert pool_numa_node(None, None, {0}) is None  # no RDMA NIC: unbound
    with caplog.at_level(logging.WARNING):
        assert pool_numa_node(None, 1, {0}) is None
    assert "NUMA node 1, where this process may not allocate" in caplog.text


def test_staging_follows_its_gpu(two_socket_host: Path) -> None:
    root = str(two_socket_host)
    assert staging_placement(torch.device("cuda:5"), root, {0, 1}).location == "cpu:1"
    assert staging_placement(torch.device("cuda:5"), root, {0, 1}).numa_node == 1
    assert staging_placement(torch.device("cuda:2"), root, {0, 1}).location == "cpu:0"
    assert staging_placement(torch.device("cuda:5"), root, {0}).numa_node is None  # not allowed: unbound
    assert staging_placement(torch.device("cpu"), root, {0, 1}).location == "cpu:0"


async def test_a_store_registers_its_pool_at_its_node(tmp_path: Path) -> None:
    node = min(allowed_memory_nodes())
    engine = TransferEngine(host=WORKER)
    await engine.start()
    service = StoreService(StoreServiceConfig(pool_path=str(tmp_path / "pool"), dram_bytes=4 << 20, host=WORKER,
                                              segment_name="kvpool-s", numa_node=node), engine)
    try:
        await service.start()
        assert engine.segment_location(service.segment_name) == f"cpu:{node}"
    finally:
        await service.stop()
        await engine.stop()


async def move(engine: TransferEngine, segment: str, store: TransferEngine, pool: str) -> None:
    ref = SegmentRef(store.endpoint, pool)
    for op in (TransferOp.WRITE, TransferOp.READ):
        await engine.wait(engine.submit([TransferRequest(op, segment, 0, ref, 0, NUM_BYTES)]), timeout_s=10)


async def test_gpu_pages_and_staging_take_the_nics_nearest_their_memory(
        two_socket_host: Path, make_engine: EngineFactory) -> None:  # noqa: F811
    topology = discover_topology(two_socket_host)
    fabric = FakeFabric({WORKER: NICS, STORE: NICS}, gpudirect={WORKER: NICS})
    worker, store = make_engine(WORKER, fabric, topology), make_engine(STORE, fabric, topology)
    await worker.start()
    await store.start()
    pools = {node: np.zeros(NUM_BYTES, np.uint8) for node in (0, 1)}
    for node, pool in pools.items():  # two stores' pools, bound to node 0 and node 1
        store.register(f"pool{node}", pool, f"cpu:{node}")
    pages = torch.randint(0, 255, (NUM_BYTES,), dtype=torch.uint8)  # host memory standing in for cuda:5's pages
    assert register_kv_pages(worker, "kv-pages", pages, torch.device("cuda:5"))
    assert worker.segment_location("kv-pages") == "cuda:5"
    await move(worker, "kv-pages", store, "pool1")
    assert set(fabric.bytes_by_pair) <= {("mlx5_2", "mlx5_2"), ("mlx5_2", "mlx5_3")}, "GPU 5's switch NIC, node 1"
    assert np.array_equal(pools[1], pages.numpy())
    fabric.bytes_by_pair.clear()
    staging = np.ones(NUM_BYTES, np.uint8)
    worker.register("staging", staging, staging_placement(torch.device("cuda:5"), str(two_socket_host),
                                                          {0, 1}).location)
    await move(worker, "staging", store, "pool0")
    assert set(fabric.bytes_by_pair) <= {(a, b) for a in ("mlx5_2", "mlx5_3") for b in ("mlx5_0", "mlx5_1")}
    with pytest.raises(ValueError, match="'kv-pages' is GPU memory: only RDMA to another host moves it"):
        worker.submit([TransferRequest(TransferOp.WRITE, "kv-pages", 0, SegmentRef(worker.endpoint, "staging"), 0, 16)])


async def test_without_gpudirect_gpu_pages_stay_staged(two_socket_host: Path, make_engine: EngineFactory,  # noqa: F811
                                                       caplog: pytest.LogCaptureFixture) -> None:
    topology = discover_topology(two_socket_host)
    fabric = FakeFabric({WORKER: NICS, STORE: NICS}, gpudirect={WORKER: NICS[:3]})  # mlx5_3 cannot map GPU memory
    worker = make_engine(WORKER, fabric, topology)
    no_rdma = make_engine(STORE, None, None)
    await worker.start()
    await no_rdma.start()
    pages = torch.zeros(NUM_BYTES, dtype=torch.uint8)
    with caplog.at_level(logging.INFO):
        assert not register_kv_pages(worker, "kv-pages", pages, torch.device("cuda:7"))
    assert "mlx5_3: cannot map GPU memory" in caplog.text and worker.segment_location("kv-pages") is None
    assert not register_kv_pages(no_rdma, "kv-pages", pages, torch.device("cuda:0"))  # no RDMA: nothing to try
    assert not register_kv_pages(worker, "kv-pages", pages, torch.device("cpu"))
