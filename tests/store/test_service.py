"""StoreService handlers called in-process (the RPC layer is covered in test_store_rpc.py)."""

import asyncio
import errno
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from mooncaked.rpc.errors import InvalidArgument, NotFound, ResourceExhausted
from mooncaked.store import messages as msg
from mooncaked.store.service import StoreService, StoreServiceConfig

BLOCK = 8192


@dataclass
class Ctx:
    deadline: float


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def block(i: int) -> bytes:
    return bytes([i % 256]) * BLOCK


def make_service(tmp_path: Path, num_blocks: int = 4, ssd_blocks: int = 0) -> StoreService:
    config = StoreServiceConfig(
        pool_path=str(tmp_path / "pool"), dram_bytes=num_blocks * BLOCK, host="test-host",
        high_watermark=1.0, low_watermark=0.75,
        ssd_dir=str(tmp_path / "ssd") if ssd_blocks else None, ssd_bytes=ssd_blocks * (BLOCK + 64),
        maintenance_interval_s=0.05)
    return StoreService(config, engine=None)


async def put(service: StoreService, ids: list[int]) -> None:
    reply = await service.allocate(msg.AllocateRequest([key(i) for i in ids], BLOCK, 10_000), Ctx(0))
    assert service.pool is not None
    for handle, i in zip(reply.handles, ids):
        service.pool.write(handle.offset, block(i))
    await service.commit(msg.CommitRequest([h.handle_id for h in reply.handles]), Ctx(0))


async def read(service: StoreService, ids: list[int]) -> list[bytes]:
    reply = await service.lookup(msg.LookupRequest([key(i) for i in ids], lease_ms=1000), Ctx(0))
    assert service.pool is not None
    data = [service.pool.read(loc.offset, loc.num_bytes) for loc in reply.locations]
    await service.release(msg.ReleaseRequest([reply.read_lease_id]), Ctx(0))
    return data


async def test_evicted_blocks_go_to_ssd_and_are_promoted_on_hit(tmp_path: Path) -> None:
    service = make_service(tmp_path, num_blocks=4, ssd_blocks=16)
    await service.start()
    await put(service, [0, 1, 2, 3])
    await put(service, [4, 5])  # evicts 0 and 1 to ssd
    peek = await service.lookup(msg.LookupRequest([key(0), key(1), key(4)]), Ctx(0))
    assert [loc.tier for loc in peek.locations] == ["ssd", "ssd", "dram"]
    assert await read(service, [0, 1, 4]) == [block(0), block(1), block(4)]
    stats = await service.stats(msg.StatsRequest(), Ctx(0))
    assert stats.counters["num_blocks"] == 6 and stats.host == "test-host"
    await service.stop()
    assert not os.path.exists(tmp_path / "pool")


async def test_ssd_contents_survive_a_restart_and_corrupt_files_are_dropped(tmp_path: Path) -> None:
    service = make_service(tmp_path, num_blocks=2, ssd_blocks=16)
    await service.start()
    await put(service, [0, 1])
    await put(service, [2, 3])  # 0 and 1 go to ssd
    await service.stop()  # 2 and 3, in DRAM, are written too: a warm restart
    ssd_files = sorted(os.listdir(tmp_path / "ssd"))
    assert ssd_files == sorted(key(i).hex() + ".blk" for i in (0, 1, 2, 3))
    with open(tmp_path / "ssd" / ssd_files[ssd_files.index(key(1).hex() + ".blk")], "r+b") as file:
        file.seek(-1, os.SEEK_END)
        file.write(b"\x00")
    restarted = make_service(tmp_path, num_blocks=2, ssd_blocks=16)
    await restarted.start()  # key 1 fails its checksum: found and deleted at start, never advertised
    seq, keys = restarted.core.dump()
    assert set(keys) == {key(0), key(2), key(3)}
    assert not os.path.exists(tmp_path / "ssd" / (key(1).hex() + ".blk"))
    assert await read(restarted, [3]) == [block(3)]
    assert await read(restarted, [0, 1]) == [block(0)]
    assert (await restarted.stats(msg.StatsRequest(), Ctx(0))).counters["ssd_num_corrupt"] == 1
    await restarted.stop()


async def test_a_stopping_store_writes_its_dram_blocks_most_recently_used_first(tmp_path: Path) -> None:
    service = make_service(tmp_path, num_blocks=4, ssd_blocks=2)  # room on ssd for two of the four
    await service.start()
    await put(service, [0, 1, 2, 3])
    assert await read(service, [1]) == [block(1)]
    assert await read(service, [3]) == [block(3)]
    await service.stop()
    assert sorted(os.listdir(tmp_path / "ssd")) == sorted(key(i).hex() + ".blk" for i in (1, 3))
    restarted = make_service(tmp_path, num_blocks=4, ssd_blocks=2)
    await restarted.start()
    assert sorted(restarted.core.dump()[1]) == sorted([key(1), key(3)])
    assert await read(restarted, [3]) == [block(3)] and await read(restarted, [1]) == [block(1)]
    await restarted.stop()


async def test_allocate_gives_a_handle_for_a_block_whose_ssd_copy_is_corrupt(tmp_path: Path) -> None:
    service = make_service(tmp_path, num_blocks=4, ssd_blocks=16)
    await service.start()
    await put(service, [0, 1])
    await service.stop()
    restarted = make_service(tmp_path, num_blocks=4, ssd_blocks=16)
    await restarted.start()
    with open(tmp_path / "ssd" / (key(1).hex() + ".blk"), "r+b") as file:  # the disk fails after start
        file.seek(-1, os.SEEK_END)
        file.write(b"\xff")  # block(1) is all 0x01
    reply = await restarted.allocate(msg.AllocateRequest([key(0), key(1), key(2)], BLOCK, 10_000), Ctx(0))
    assert [loc.key for loc in reply.present] == [key(0)] and reply.present[0].tier == "dram"
    assert sorted(h.key for h in reply.handles) == [key(1), key(2)], "every key: present in DRAM or writable"
    assert restarted.pool is not None and restarted.pool.read(reply.present[0].offset, BLOCK) == block(0)
    await restarted.stop()


async def test_maintenance_reclaims_expired_allocations(tmp_path: Path) -> None:
    service = make_service(tmp_path, num_blocks=4)
    await service.start()
    await service.allocate(msg.AllocateRequest([key(1)], BLOCK, 50), Ctx(0))
    assert service.core.allocator.num_used_bytes == BLOCK
    deadline = time.monotonic() + 5
    while service.core.allocator.num_used_bytes and time.monotonic() < deadline:
        await asyncio.sleep(0.02)  # the maintenance task expires the 50 ms lease
    assert service.core.allocator.num_used_bytes == 0
    await service.stop()


async def test_bad_requests_map_to_rpc_errors(tmp_path: Path) -> None:
    service = make_service(tmp_path, num_blocks=2)
    await service.start()
    with pytest.raises(InvalidArgument, match="lease_ms"):
        await service.allocate(msg.AllocateRequest([key(1)], BLOCK, 0), Ctx(0))
    for ttl_ms in (0, 10**15):  # a pin held for ever is a leak
        with pytest.raises(InvalidArgument, match=r"ttl_ms must be in 1\.\.86400000"):
            await service.pin(msg.PinRequest([key(1)], ttl_ms), Ctx(0))
    with pytest.raises(InvalidArgument, match="16 bytes"):
        await service.lookup(msg.LookupRequest([b"x"]), Ctx(0))
    with pytest.raises(NotFound, match="not outstanding"):
        await service.commit(msg.CommitRequest([42]), Ctx(0))
    with pytest.raises(ResourceExhausted, match="store full"):
        await service.allocate(msg.AllocateRequest([key(i) for i in range(3)], BLOCK, 1000), Ctx(0))
    assert service.core.allocator.num_used_bytes == 0
    await service.stop()


async def test_pinned_blocks_never_leave_every_tier_an_allocation_needing_them_fails(tmp_path: Path) -> None:
    service = make_service(tmp_path, num_blocks=4, ssd_blocks=1)  # the ssd tier has room for one block
    await service.start()
    await put(service, [0, 1, 2, 3])
    await service.pin(msg.PinRequest([key(i) for i in range(4)], 60_000), Ctx(0))
    with pytest.raises(ResourceExhausted, match="pinned"):
        await service.allocate(msg.AllocateRequest([key(4), key(5)], BLOCK, 10_000), Ctx(0))
    assert sorted(service.core.dump()[1]) == [key(i) for i in range(4)]
    assert await read(service, [0, 1, 2, 3]) == [block(i) for i in range(4)]
    await service.stop()


async def test_a_failed_ssd_write_unadvertises_the_block_with_an_event(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_replace(source: str, target: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    service = make_service(tmp_path, num_blocks=2, ssd_blocks=16)
    await service.start()
    monkeypatch.setattr(os, "replace", failing_replace)
    await put(service, [0, 1])
    await put(service, [2])  # evicts 0 towards ssd, whose write fails
    async with asyncio.timeout(5):
        while service.core.location(key(0)) is not None:
            await asyncio.sleep(0.01)
    events = [(e.kind, e.key) for e in service.core.events_after(0) or []]
    assert events[-1] == ("removed", key(0))
    assert (await service.lookup(msg.LookupRequest([key(0)]), Ctx(0))).locations == []
    stats = await service.stats(msg.StatsRequest(), Ctx(0))
    assert stats.counters["num_ssd_blocks"] == 0 and stats.counters["ssd_used_bytes"] == 0
    monkeypatch.undo()
    await service.stop()


async def test_a_block_counts_as_on_ssd_once_it_is_on_disk(tmp_path: Path) -> None:
    service = make_service(tmp_path, num_blocks=2, ssd_blocks=16)
    await service.start()
    await put(service, [0, 1])
    await put(service, [2])  # evicts 0 to ssd
    async with asyncio.timeout(5):
        while (await service.stats(msg.StatsRequest(), Ctx(0))).counters["num_ssd_blocks"] != 1:
            await asyncio.sleep(0.01)
    assert os.path.exists(tmp_path / "ssd" / (key(0).hex() + ".blk"))
    await service.stop()


async def test_the_maintenance_loop_survives_an_unexpected_exception(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    service = make_service(tmp_path, num_blocks=4)
    expire = service.core.expire
    calls: list[float] = []

    def expire_failing_once(now: float) -> int:
        calls.append(now)
        if len(calls) == 1:
            raise KeyError("injected")
        return expire(now)

    service.core.expire = expire_failing_once  # type: ignore[method-assign]
    await service.start()
    await service.allocate(msg.AllocateRequest([key(1)], BLOCK, 50), Ctx(0))
    async with asyncio.timeout(5):
        while service.core.allocator.num_used_bytes:
            await asyncio.sleep(0.02)  # the restarted loop expires the 50 ms lease
    assert "background loop store-maintenance failed: KeyError: 'injected'; restarting it" in caplog.text
    await service.stop()
