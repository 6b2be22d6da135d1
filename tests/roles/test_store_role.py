import os
from pathlib import Path

import numpy as np

from mooncaked.config import ClusterSection, Config, InstanceConfig, StoreSection
from mooncaked.roles.store import StoreRole
from mooncaked.rpc import RpcClient
from mooncaked.rpc.protocol import HEALTH, INFO, HealthRequest, InfoRequest
from mooncaked.store.client import StoreClient
from mooncaked.transfer import TransferEngine


def make_config(tmp_path: Path) -> tuple[Config, InstanceConfig]:
    instance = InstanceConfig(name="store-0", role="store", host="127.0.0.1", port=0)
    config = Config(
        cluster=ClusterSection(id="role-test", instances=[instance]),
        store=StoreSection(dram_bytes=4 << 20, shm_dir=str(tmp_path), ssd_dir=str(tmp_path / "ssd"),
                           ssd_bytes=8 << 20, maintenance_interval_s=0.05),
    )
    return config, instance


async def test_store_role_serves_health_info_and_blocks_then_cleans_up(tmp_path: Path) -> None:
    config, instance = make_config(tmp_path)
    role = StoreRole(config, instance)
    await role.start()
    rpc = RpcClient(f"tcp://127.0.0.1:{role.endpoint.bound_port}", role="decode", instance="d0",
                    cluster_id="role-test", secret=None)
    engine = TransferEngine(host="127.0.0.2", transports=("tcp",), cluster_id="role-test")
    await engine.start()
    try:
        assert (await rpc.call(HEALTH, HealthRequest(), timeout_s=5)).is_healthy
        info = await rpc.call(INFO, InfoRequest(), timeout_s=5)
        assert info.role == "store" and info.extra["pool_path"] == str(tmp_path / "mooncaked-role-test-store-0")
        assert os.path.exists(info.extra["pool_path"]) and os.path.isdir(tmp_path / "ssd" / "store-0")
        client = await StoreClient.connect(rpc, host="127.0.0.2", engine=engine, timeout_s=5, pool_path=None)
        data = np.arange(65536, dtype=np.uint8)
        reply = await client.allocate([bytes(16)], data.nbytes, lease_ms=5000)
        await client.write_blocks(client.register_staging("put", data.copy()), reply.handles)
        await client.commit([h.handle_id for h in reply.handles])
        found = await client.lookup([bytes(16)], lease_ms=5000)
        staging = client.register_staging("get", np.zeros_like(data))
        await client.read_blocks(staging, found.locations)
        assert np.array_equal(staging.array, data)
        await client.close()
    finally:
        await rpc.close()
        await engine.stop()
        await role.stop()
    assert not os.path.exists(info.extra["pool_path"])
