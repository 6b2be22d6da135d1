"""A store that restarts under its clients: offsets of its earlier run are refused before any byte moves, and the
clients go on with the new run (same host: the new pool file is mapped; another host: the new segment is used)."""

from pathlib import Path

import numpy as np
import pytest

from mooncaked.rpc import NotFound, RpcServer
from mooncaked.store.client import StaleOffsets
from mooncaked.store.service import StoreService, StoreServiceConfig
from mooncaked.transfer import TransferEngine
from tests.store.test_store_rpc import BLOCK, key, open_client_at


class StoreRun:
    """One run of a store at `port` (0: any free one) over the pool file in `tmp_path`."""

    def __init__(self, tmp_path: Path, port: int) -> None:
        self.engine = TransferEngine(host="127.0.0.1", transports=("local", "tcp"))
        self.service = StoreService(StoreServiceConfig(pool_path=str(tmp_path / "pool"), dram_bytes=16 * BLOCK,
                                                       host="127.0.0.1"), self.engine)
        self.server = RpcServer(role="store", instance="s0", cluster_id="test", secret=None)
        self.port = port
        self.is_running = False

    async def start(self) -> None:
        await self.engine.start()
        await self.service.start()
        self.service.add_methods(self.server)
        self.port = await self.server.start_tcp("127.0.0.1", self.port)
        self.is_running = True

    async def stop(self) -> None:
        if self.is_running:
            self.is_running = False
            await self.server.stop(1.0)
            await self.service.stop()
            await self.engine.stop()


def filled(value: int, num_blocks: int = 1) -> np.ndarray:
    return np.full(num_blocks * BLOCK, value, dtype=np.uint8)


@pytest.mark.parametrize("path", ["local", "remote"])
async def test_offsets_of_an_earlier_run_are_refused_and_the_client_goes_on(tmp_path: Path, path: str) -> None:
    first = StoreRun(tmp_path, 0)
    await first.start()
    second = StoreRun(tmp_path, first.port)
    try:
        async with open_client_at(f"tcp://127.0.0.1:{first.port}", path, str(tmp_path / "pool")) as client:
            source, sink = client.register_staging("source", filled(5)), client.register_staging("sink", filled(0))
            written = (await client.allocate([key(1)], BLOCK, 10_000)).handles
            await client.write_blocks(source, written)
            await client.commit([h.handle_id for h in written])
            stale_locations = (await client.lookup([key(1)], lease_ms=10_000)).locations
            stale_handles = (await client.allocate([key(2)], BLOCK, 10_000)).handles
            await first.stop()
            await second.start()

            fresh = (await client.allocate([key(3), key(4)], BLOCK, 10_000)).handles
            assert [h.offset for h in fresh] == [stale_locations[0].offset, stale_handles[0].offset]
            await client.write_blocks(client.register_staging("both", filled(7, 2)), fresh)
            await client.commit([h.handle_id for h in fresh])
            with pytest.raises(StaleOffsets, match="restarted"):
                await client.write_blocks(client.register_staging("other", filled(9)), stale_handles)
            with pytest.raises(StaleOffsets, match="restarted"):
                await client.read_blocks(sink, stale_locations)
            with pytest.raises(NotFound, match="not outstanding"):
                await client.commit([h.handle_id for h in stale_handles])  # no old id names a new handle

            found = await client.lookup([key(3), key(4)], lease_ms=10_000)
            for location in found.locations:
                await client.read_blocks(sink, [location])
                assert sink.array.tolist() == filled(7).tolist(), "the new run's blocks are left alone"
    finally:
        await second.stop()
        await first.stop()
