import asyncio
import contextlib
import errno
import os
import stat
import subprocess
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path

import pytest

from mooncaked.store.ssd import SsdConfig, SsdTier


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def payload(i: int, num_bytes: int = 10_000) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(num_bytes))


def make_tier(directory: Path, budget_bytes: int = 1 << 20, pinned: frozenset[bytes] = frozenset(),
              dropped: list[bytes] | None = None, written: list[bytes] | None = None) -> SsdTier:
    def is_evictable(k: Hashable) -> bool:
        return k not in pinned

    sink = dropped if dropped is not None else []
    written_sink = written if written is not None else []
    return SsdTier(SsdConfig(str(directory), budget_bytes), is_evictable, sink.append, written_sink.append)


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


@contextlib.contextmanager
def small_tmpfs(path: Path, num_bytes: int) -> Iterator[Path]:
    """A tmpfs of `num_bytes` mounted at `path` for the test (skips where this process may not mount one)."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={num_bytes}", "tmpfs", str(path)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


async def test_round_trip_from_backlog_and_from_file(tmp_path: Path) -> None:
    tier = make_tier(tmp_path)
    assert tier.start(0.0) == []
    assert tier.put(key(1), payload(1), 0.0)
    assert await tier.get(key(1), 0.0) == payload(1)  # served from the write-behind backlog or the file
    tier.stop(5.0)
    assert os.path.getsize(tier.path_of(key(1))) > 10_000
    reopened = make_tier(tmp_path)
    reopened.start(1.0)
    assert await reopened.get(key(1), 1.0) == payload(1)
    reopened.stop(5.0)


async def test_restart_indexes_directory_and_deletes_torn_files(tmp_path: Path) -> None:
    tier = make_tier(tmp_path)
    tier.start(0.0)
    for i in range(3):
        tier.put(key(i), payload(i), 0.0)
    tier.stop(5.0)
    with open(tier.path_of(key(2)), "r+b") as file:
        file.truncate(5000)  # torn write
    (tmp_path / "leftover.blk.tmp").write_bytes(b"partial")
    reopened = make_tier(tmp_path)
    found = reopened.start(1.0)
    assert sorted(found) == [(key(0), 10_000), (key(1), 10_000)]
    assert sorted(os.listdir(tmp_path)) == sorted(key(i).hex() + ".blk" for i in range(2))
    reopened.stop(5.0)


async def test_a_file_torn_after_start_is_detected_deleted_and_never_served(tmp_path: Path) -> None:
    tier = make_tier(tmp_path)
    tier.start(0.0)
    tier.put(key(1), payload(1), 0.0)
    tier.stop(5.0)
    dropped: list[bytes] = []
    reopened = make_tier(tmp_path, dropped=dropped)
    assert reopened.start(1.0) == [(key(1), 10_000)]
    with open(tier.path_of(key(1)), "r+b") as file:
        file.seek(-1, os.SEEK_END)
        file.write(b"\xff")  # same size, wrong checksum
    assert await reopened.get(key(1), 1.0) is None
    assert dropped == [key(1)] and key(1) not in reopened and reopened.num_corrupt == 1
    reopened.stop(5.0)
    assert os.listdir(tmp_path) == []


async def test_files_torn_by_a_crash_are_found_at_start_by_their_checksum(tmp_path: Path) -> None:
    tier = make_tier(tmp_path)
    tier.start(0.0)
    for i in range(3):
        tier.put(key(i), payload(i), 0.0)
    tier.stop(5.0)
    with open(tier.path_of(key(1)), "r+b") as file:
        file.seek(-1, os.SEEK_END)
        file.write(b"\xff")  # same size, wrong checksum: a header written whole, a payload not
    reopened = make_tier(tmp_path)
    assert sorted(reopened.start(1.0)) == [(key(0), 10_000), (key(2), 10_000)]
    assert key(1) not in reopened and reopened.num_corrupt == 1
    assert sorted(os.listdir(tmp_path)) == sorted(key(i).hex() + ".blk" for i in (0, 2))
    reopened.stop(5.0)


async def test_an_object_is_fsynced_before_its_rename_and_its_directory_after(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        calls.append("fsync directory" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def replace(source: str, target: str) -> None:
        calls.append("rename")
        real_replace(source, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    written: list[bytes] = []
    tier = make_tier(tmp_path, written=written)
    tier.start(0.0)
    assert tier.put(key(1), payload(1), 0.0)
    await until(lambda: written == [key(1)])  # reported written only once durable
    assert calls == ["fsync file", "rename", "fsync directory"]
    tier.stop(5.0)


async def test_a_failed_write_is_reported_dropped_and_frees_its_budget(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_replace(source: str, target: str) -> None:
        raise OSError(errno.EIO, "Input/output error (injected)")

    monkeypatch.setattr(os, "replace", failing_replace)
    dropped: list[bytes] = []
    written: list[bytes] = []
    tier = make_tier(tmp_path, dropped=dropped, written=written)
    tier.start(0.0)
    assert tier.put(key(1), payload(1), 0.0)
    await until(lambda: dropped == [key(1)])
    assert key(1) not in tier and tier.num_used_bytes == 0 and written == []
    assert await tier.get(key(1), 0.0) is None
    tier.stop(5.0)
    assert os.listdir(tmp_path) == []  # no temporary file left behind


async def test_a_full_filesystem_fails_writes_cleanly(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "small", 64 << 10) as directory:  # room for about six 10 kB objects
        dropped: list[bytes] = []
        written: list[bytes] = []
        tier = make_tier(directory, dropped=dropped, written=written)  # the budget (1 MiB) is not the limit
        tier.start(0.0)
        for i in range(12):
            assert tier.put(key(i), payload(i), 0.0)
        await until(lambda: len(dropped) + len(written) == 12)
        assert dropped and written and set(dropped) | set(written) == {key(i) for i in range(12)}
        assert all(key(i) in tier for i in range(12) if key(i) in written)
        assert not any(key(i) in tier for i in range(12) if key(i) in dropped)
        for k in written:
            assert await tier.get(k, 1.0) == payload(int.from_bytes(k, "little"))
        tier.stop(5.0)
        assert sorted(os.listdir(directory)) == sorted(k.hex() + ".blk" for k in written)


async def test_budget_evicts_by_policy_but_keeps_pinned(tmp_path: Path) -> None:
    dropped: list[bytes] = []
    tier = make_tier(tmp_path, budget_bytes=3 * 10_100, pinned=frozenset({key(0)}), dropped=dropped)
    tier.start(0.0)
    for i in range(3):
        assert tier.put(key(i), payload(i), float(i))
    assert tier.put(key(3), payload(3), 3.0)
    assert dropped == [key(1)]  # key 0 is older but pinned
    assert key(0) in tier and key(3) in tier
    assert not tier.put(key(9), payload(9, 40_000), 4.0)  # larger than the whole budget
    tier.stop(5.0)
    assert not os.path.exists(tier.path_of(key(1)))


async def test_persist_goes_first_and_never_evicts_what_it_queued_before(tmp_path: Path) -> None:
    header = 38  # the object file's header
    dropped: list[bytes] = []
    tier = make_tier(tmp_path, budget_bytes=3 * (10_000 + header), dropped=dropped)
    tier.start(0.0)
    assert tier.put(key(9), payload(9), 0.0)  # an older, colder object already on the tier
    blocks = [(key(i), memoryview(payload(i))) for i in range(4)]  # most valuable first
    assert tier.persist(blocks, 1.0) == [key(0), key(1), key(2)]  # 3 fit once key 9 makes room; key 3 would not
    assert dropped == [key(9)]
    tier.stop(10.0)
    assert tier.num_unwritten([key(0), key(1), key(2)]) == 0
    reopened = make_tier(tmp_path, budget_bytes=3 * (10_000 + header))
    assert sorted(k for k, _ in reopened.start(2.0)) == [key(0), key(1), key(2)]
    assert await reopened.get(key(2), 2.0) == payload(2)
    reopened.stop(5.0)
