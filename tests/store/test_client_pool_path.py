"""What a store's STATS reply can make a same-host worker map: only the pool file the worker's own config names,
and only when it is a regular file of this user, of the size the store reports (never a path the peer names)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from mooncaked.store import messages as msg
from mooncaked.store.client import StoreClient
from mooncaked.store.shm_pool import PoolFileRefused, ShmPool


class HostileStore:
    """A peer whose STATS reply names whatever file it likes (no other call is made)."""

    def __init__(self, pool_path: str, pool_bytes: int) -> None:
        self.stats = msg.StatsReply({}, pool_path, pool_bytes, "127.0.0.1:1", "kvpool-s0.1", "127.0.0.1", 1)

    async def call(self, method: Any, request: Any, *, timeout_s: float) -> Any:
        assert method is msg.STATS
        return self.stats

    def stream(self, method: Any, request: Any, *, timeout_s: float) -> Any:
        raise AssertionError("not called")


async def test_a_file_the_store_names_is_never_mapped_unless_the_config_names_it(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious" * 512)
    hostile = HostileStore(str(victim), victim.stat().st_size)
    with pytest.raises(PoolFileRefused, match="this worker's config puts it at"):
        await StoreClient.connect(hostile, host="127.0.0.1", pool_path=str(tmp_path / "pool"))
    with pytest.raises(ValueError, match="pass a started TransferEngine"):
        await StoreClient.connect(hostile, host="127.0.0.1", pool_path=None)
    assert victim.read_bytes() == b"precious" * 512


async def test_a_pool_path_that_is_a_link_or_the_wrong_size_is_refused(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(bytes(4096))
    os.symlink(victim, tmp_path / "pool")
    hostile = HostileStore(str(tmp_path / "pool"), 4096)
    with pytest.raises(PoolFileRefused, match="symbolic link"):
        await StoreClient.connect(hostile, host="127.0.0.1", pool_path=str(tmp_path / "pool"))
    os.unlink(tmp_path / "pool")
    pool = ShmPool.create(str(tmp_path / "pool"), 8192)
    try:
        hostile = HostileStore(str(tmp_path / "pool"), 4096)
        with pytest.raises(PoolFileRefused, match="8192 bytes, the store reports 4096"):
            await StoreClient.connect(hostile, host="127.0.0.1", pool_path=str(tmp_path / "pool"))
        honest = HostileStore(str(tmp_path / "pool"), 8192)
        client = await StoreClient.connect(honest, host="127.0.0.1", pool_path=str(tmp_path / "pool"))
        assert client.is_local
        await client.close()
    finally:
        pool.close()
