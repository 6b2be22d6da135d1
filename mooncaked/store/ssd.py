"""SSD tier: blocks evicted from DRAM, written behind to one file each, within a byte budget.

1. `start()` indexes the directory: every well-formed object file becomes present again (contents survive a
   restart); temporary files and files whose size disagrees with their header are deleted with a warning.
   Then a writer thread starts.
2. `put(key, data, now)` (event loop) reserves budget, evicting other objects by policy (never ones the store
   says are pinned or leased), and queues the write; until the thread has written it, `get` serves it from memory.
3. The thread writes `<key hex>.blk` through a temporary file and a rename, so a reader sees a whole file or none.
   File layout: header (magic, version, key, payload length, xxh3_64 of the payload), then the payload.
4. `get(key)` reads and verifies in a worker thread; a torn or corrupted file is logged, deleted, reported
   through `on_dropped` and never served.
5. `persist(blocks, now)` (a store stopping for a warm restart) queues DRAM blocks, most valuable first, ahead of
   the write-behind backlog, writing straight from the pool's memory; it stops where the budget would have to
   give up one of them.
6. `stop(deadline_s)` lets the thread finish queued operations until the deadline, then has it abandon the rest
   (a write under way completes: files appear whole or not at all).
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import threading
from collections import deque
from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass

import xxhash

from mooncaked.kv.eviction import make_eviction_policy
from mooncaked.kv.keys import KEY_BYTES

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("<4sH16sQQ")  # magic, version, key, payload length, xxh3_64(payload)
_MAGIC = b"MCKV"
_VERSION = 1
_SUFFIX = ".blk"


@dataclass(frozen=True)
class SsdConfig:
    directory: str
    budget_bytes: int
    eviction_policy: str = "lru"
    max_pending_bytes: int = 256 << 20  # write-behind backlog held in memory; beyond it evictions are dropped


def encode_header(key: bytes, payload: bytes | memoryview) -> bytes:
    return _HEADER.pack(_MAGIC, _VERSION, key, len(payload), xxhash.xxh3_64_intdigest(payload))


class SsdTier:
    """Object files of one store. Owner: the `StoreService`; this class owns the directory, the index, the
    budget and the write queue (shared with its thread under `_lock`)."""

    def __init__(self, config: SsdConfig, is_evictable: Callable[[Hashable], bool],
                 on_dropped: Callable[[bytes], None]) -> None:
        if config.budget_bytes <= 0:
            raise ValueError(f"ssd budget_bytes must be positive, got {config.budget_bytes}")
        self.config = config
        self._is_evictable = is_evictable
        self._on_dropped = on_dropped
        self._policy = make_eviction_policy(config.eviction_policy)
        self._sizes: dict[bytes, int] = {}  # key -> payload bytes, for every object on disk or queued
        self.num_used_bytes = 0
        self._lock = threading.Lock()
        self._has_work = threading.Condition(self._lock)
        self._pending: dict[bytes, bytes | memoryview] = {}  # queued writes, readable until written
        self._pending_bytes = 0
        self._operations: deque[tuple[str, bytes] | None] = deque()  # ("write"|"delete", key); None: finish
        self._is_abandoned = False
        self._thread: threading.Thread | None = None
        self.num_corrupt = 0

    # ---- lifecycle ----------------------------------------------------------------------------------------
    def start(self, now: float) -> list[tuple[bytes, int]]:
        """Index the directory and start the writer thread; returns the (key, payload bytes) found."""
        os.makedirs(self.config.directory, exist_ok=True)
        found = self._index(now)
        self._thread = threading.Thread(target=self._write_loop, name="mooncaked-ssd-writer", daemon=True)
        self._thread.start()
        return found

    def stop(self, deadline_s: float) -> None:
        if self._thread is None:
            return
        self._enqueue(None)
        self._thread.join(deadline_s)
        if self._thread.is_alive():
            with self._has_work:
                self._is_abandoned = True
                num_left = sum(1 for operation in self._operations if operation is not None)
                self._has_work.notify()
            logger.warning("ssd writer did not finish %d queued operations within %.1fs; they are lost",
                           num_left, deadline_s)
        self._thread = None

    def num_unwritten(self, keys: Collection[bytes]) -> int:
        """How many of `keys` were queued for writing and are not on disk (after stop: never will be)."""
        with self._lock:
            return sum(1 for key in keys if key in self._pending)

    # ---- event-loop side ----------------------------------------------------------------------------------
    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def put(self, key: bytes, data: bytes, now: float, position: int = 0) -> bool:
        """Queue `data` for writing; False (nothing queued) when budget or backlog cannot take it."""
        assert len(key) == KEY_BYTES
        if key in self._sizes:
            return True  # immutable objects: the copy on disk is the same
        if self._pending_bytes + len(data) > self.config.max_pending_bytes or not self._make_room(len(data)):
            return False
        self._add(key, data, now, position)
        self._enqueue(("write", key))
        return True

    def persist(self, blocks: Sequence[tuple[bytes, memoryview]], now: float) -> list[bytes]:
        """Queue `blocks` (most valuable first) ahead of everything else, writing from the given memory (it must
        stay mapped until `stop` returns); returns the keys queued. Stops at the first block that fits only by
        evicting one queued before it."""
        queued: list[bytes] = []
        protected: set[bytes] = set()
        for key, data in blocks:
            if key in self._sizes:
                continue
            if not self._make_room(len(data), protected):
                break
            self._add(key, data, now, 0)
            protected.add(key)
            queued.append(key)
        with self._has_work:
            self._operations.extendleft(("write", key) for key in reversed(queued))
            self._has_work.notify()
        return queued

    def _add(self, key: bytes, data: bytes | memoryview, now: float, position: int) -> None:
        self._sizes[key] = len(data)
        self.num_used_bytes += len(data) + _HEADER.size
        self._policy.on_insert(key, now, position)
        with self._lock:
            self._pending[key] = data
            self._pending_bytes += len(data)

    def _enqueue(self, operation: tuple[str, bytes] | None) -> None:
        with self._has_work:
            self._operations.append(operation)
            self._has_work.notify()

    async def get(self, key: bytes, now: float) -> bytes | None:
        """The object's bytes, or None when absent or found corrupt (then deleted and reported)."""
        if key not in self._sizes:
            return None
        self._policy.on_access(key, now, 0)
        with self._lock:
            pending = self._pending.get(key)
        if pending is not None:
            return bytes(pending)
        data, problem = await asyncio.to_thread(self._read_file, key)
        if data is None:
            if key in self._sizes:
                logger.warning("ssd object %s unreadable (%s); deleted", key.hex(), problem)
                self.num_corrupt += 1
                self.remove(key)
                self._on_dropped(key)
            return None
        return data

    def remove(self, key: bytes) -> None:
        size = self._sizes.pop(key, None)
        if size is None:
            return
        self.num_used_bytes -= size + _HEADER.size
        self._policy.on_remove(key)
        with self._lock:
            data = self._pending.pop(key, None)
            self._pending_bytes -= len(data) if data is not None else 0
        self._enqueue(("delete", key))

    def path_of(self, key: bytes) -> str:
        return os.path.join(self.config.directory, key.hex() + _SUFFIX)

    def _make_room(self, num_bytes: int, protected: Collection[bytes] = ()) -> bool:
        """Evict objects by policy until `num_bytes` fit; when they cannot fit, evict nothing and return False."""
        num_over = self.num_used_bytes + num_bytes + _HEADER.size - self.config.budget_bytes
        if num_bytes + _HEADER.size > self.config.budget_bytes:
            return False
        victims: list[bytes] = []
        for victim in self._policy.victims(lambda key: key not in protected and self._is_evictable(key)):
            if num_over <= 0:
                break
            victims.append(victim)  # type: ignore[arg-type]
            num_over -= self._sizes[victim] + _HEADER.size  # type: ignore[index]
        if num_over > 0:
            return False
        for victim in victims:
            self.remove(victim)
            self._on_dropped(victim)
        return True

    def _index(self, now: float) -> list[tuple[bytes, int]]:
        found: list[tuple[bytes, int]] = []
        for name in sorted(os.listdir(self.config.directory)):
            path = os.path.join(self.config.directory, name)
            key = _read_header_key(path) if name.endswith(_SUFFIX) else None
            if key is None or name != key.hex() + _SUFFIX:
                logger.warning("ssd tier: deleting %s (temporary, torn or foreign object file)", path)
                _unlink(path)
                continue
            size = os.path.getsize(path) - _HEADER.size
            if self.num_used_bytes + size + _HEADER.size > self.config.budget_bytes:
                logger.warning("ssd tier: deleting %s (over the budget of %d bytes)", path, self.config.budget_bytes)
                _unlink(path)
                continue
            self._sizes[key] = size
            self.num_used_bytes += size + _HEADER.size
            self._policy.on_insert(key, now, 0)
            found.append((key, size))
        return found

    # ---- thread side --------------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            with self._has_work:
                while not self._operations and not self._is_abandoned:
                    self._has_work.wait()
                if self._is_abandoned:
                    return
                item = self._operations.popleft()
            if item is None:
                return
            op, key = item
            try:
                if op == "write":
                    self._write_pending(key)
                else:
                    _unlink(self.path_of(key))
            except OSError as error:
                logger.error("ssd tier: %s of %s failed: %s", op, key.hex(), error)

    def _write_pending(self, key: bytes) -> None:
        with self._lock:
            data = self._pending.get(key)
        if data is None:
            return
        path = self.path_of(key)
        temporary = path + ".tmp"
        try:
            with open(temporary, "wb") as file:
                file.write(encode_header(key, data))
                file.write(data)
            os.replace(temporary, path)
        finally:
            with self._lock:
                if self._pending.get(key) is data:
                    del self._pending[key]
                    self._pending_bytes -= len(data)

    def _read_file(self, key: bytes) -> tuple[bytes | None, str]:
        try:
            with open(self.path_of(key), "rb") as file:
                blob = file.read()
        except OSError as error:
            return None, str(error)
        if len(blob) < _HEADER.size:
            return None, "shorter than its header"
        magic, version, stored_key, length, checksum = _HEADER.unpack_from(blob)
        payload = memoryview(blob)[_HEADER.size :]
        if magic != _MAGIC or version != _VERSION or stored_key != key:
            return None, "bad header"
        if len(payload) != length:
            return None, f"torn: {len(payload)} of {length} payload bytes"
        if xxhash.xxh3_64_intdigest(payload) != checksum:
            return None, "checksum mismatch"
        return bytes(payload), ""


def _read_header_key(path: str) -> bytes | None:
    """The key of a plausible object file (header intact, size matches), else None."""
    try:
        with open(path, "rb") as file:
            header = file.read(_HEADER.size)
        size = os.path.getsize(path)
    except OSError:
        return None
    if len(header) != _HEADER.size:
        return None
    magic, version, key, length, _ = _HEADER.unpack(header)
    if magic != _MAGIC or version != _VERSION or size != _HEADER.size + length:
        return None
    return bytes(key)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
