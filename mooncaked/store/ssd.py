"""SSD tier: blocks evicted from DRAM, written behind to one file each, within a byte budget.

1. `start()` (on the event loop) indexes the directory: every object file whose checksum holds becomes present
   again (contents survive a restart); temporary files and torn or corrupt ones (a crash mid-write) are deleted
   with a warning. Then a writer thread starts.
2. `put(key, data, now)` (event loop) reserves budget, evicting other objects by policy (never ones the store
   says are pinned or leased), and queues the write; until the thread has written it, `get` serves it from memory.
3. The thread writes `<key hex>.blk` through a temporary file, fsync'd before its rename, and fsyncs the directory
   after it, so a reader (or a restart after a crash) sees a whole file or none (ssd_files.py: the file format).
   Each outcome goes back to the event loop (`_settle`): a durable object is reported through `on_written`; a failed write (ENOSPC, EIO) is logged,
   its budget freed and the object reported through `on_dropped`, so the store stops advertising it.
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
import threading
from collections import deque
from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass

from mooncaked.kv.eviction import make_eviction_policy
from mooncaked.kv.keys import KEY_BYTES
from mooncaked.store.ssd_files import HEADER_BYTES, SUFFIX, read_header_key, read_object, unlink_quietly, write_object

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class SsdConfig:
    directory: str
    budget_bytes: int
    eviction_policy: str = "lru"
    max_pending_bytes: int = 256 << 20  # write-behind backlog held in memory; beyond it evictions are dropped


class SsdTier:
    """Object files of one store. Owner: the `StoreService`; this class owns the directory, the index, the
    budget and the write queue (shared with its thread under `_lock`)."""

    def __init__(self, config: SsdConfig, is_evictable: Callable[[Hashable], bool],
                 on_dropped: Callable[[bytes], None], on_written: Callable[[bytes], None]) -> None:
        if config.budget_bytes <= 0:
            raise ValueError(f"ssd budget_bytes must be positive, got {config.budget_bytes}")
        self.config = config
        self._is_evictable = is_evictable
        self._on_dropped = on_dropped
        self._on_written = on_written
        self._policy = make_eviction_policy(config.eviction_policy)
        self._sizes: dict[bytes, int] = {}  # key -> payload bytes, for every object on disk or queued
        self.num_used_bytes = 0
        self._lock = threading.Lock()
        self._has_work = threading.Condition(self._lock)
        self._pending: dict[bytes, bytes | memoryview] = {}  # queued writes, readable until written
        self._pending_bytes = 0
        self._operations: deque[tuple[str, bytes] | None] = deque()  # ("write"|"delete", key); None: finish
        self._is_abandoned = False
        self._outcomes: list[tuple[bytes, bytes | memoryview, OSError | None]] = []  # thread -> loop, under _lock
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.num_corrupt = 0
        self.num_failed_writes = 0

    # ---- lifecycle ----------------------------------------------------------------------------------------
    def start(self, now: float) -> list[tuple[bytes, int]]:
        """Index the directory and start the writer thread; returns the (key, payload bytes) found."""
        self._loop = asyncio.get_running_loop()
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
        """How many of `keys` (queued for writing) are not on disk (after stop: never will be): still queued, their
        write failed, or dropped since."""
        with self._lock:
            failed = {key for key, _, error in self._outcomes if error is not None}
            return sum(1 for key in keys if key in self._pending or key in failed or key not in self._sizes)

    @property
    def num_pending_bytes(self) -> int:
        """Bytes queued for writing and not yet on disk."""
        return self._pending_bytes

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
        self.num_used_bytes += len(data) + HEADER_BYTES
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
        data, problem = await asyncio.to_thread(read_object, self.path_of(key), key)
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
        self.num_used_bytes -= size + HEADER_BYTES
        self._policy.on_remove(key)
        with self._lock:
            data = self._pending.pop(key, None)
            self._pending_bytes -= len(data) if data is not None else 0
        self._enqueue(("delete", key))

    def path_of(self, key: bytes) -> str:
        return os.path.join(self.config.directory, key.hex() + SUFFIX)

    def _make_room(self, num_bytes: int, protected: Collection[bytes] = ()) -> bool:
        """Evict objects by policy until `num_bytes` fit; when they cannot fit, evict nothing and return False."""
        num_over = self.num_used_bytes + num_bytes + HEADER_BYTES - self.config.budget_bytes
        if num_bytes + HEADER_BYTES > self.config.budget_bytes:
            return False
        victims: list[bytes] = []
        for victim in self._policy.victims(lambda key: key not in protected and self._is_evictable(key)):
            if num_over <= 0:
                break
            victims.append(victim)  # type: ignore[arg-type]
            num_over -= self._sizes[victim] + HEADER_BYTES  # type: ignore[index]
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
            key = read_header_key(path) if name.endswith(SUFFIX) else None
            if key is None or name != key.hex() + SUFFIX:
                logger.warning("ssd tier: deleting %s (temporary, torn or foreign object file)", path)
                unlink_quietly(path)
                continue
            data, problem = read_object(self.path_of(key), key)
            if data is None:
                logger.warning("ssd tier: deleting %s (%s: torn by a crash or corrupt)", path, problem)
                self.num_corrupt += 1
                unlink_quietly(path)
                continue
            size = len(data)
            if self.num_used_bytes + size + HEADER_BYTES > self.config.budget_bytes:
                logger.warning("ssd tier: deleting %s (over the budget of %d bytes)", path, self.config.budget_bytes)
                unlink_quietly(path)
                continue
            self._sizes[key] = size
            self.num_used_bytes += size + HEADER_BYTES
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
            if op == "write":
                self._write_pending(key)
                continue
            try:
                unlink_quietly(self.path_of(key))
            except OSError as error:  # the object is gone from the index already: only its file stays
                logger.error("ssd tier: deleting %s failed: %s", key.hex(), error)

    def _write_pending(self, key: bytes) -> None:
        """Write one queued object durably; its outcome goes to the event loop. A failed write leaves its bytes
        queued (still served) until the loop drops the object."""
        with self._lock:
            data = self._pending.get(key)
        if data is None:
            return
        error: OSError | None = None
        try:
            write_object(self.path_of(key), key, data)
        except OSError as failure:
            error = failure
        with self._lock:
            if error is None and self._pending.get(key) is data:
                del self._pending[key]
                self._pending_bytes -= len(data)
            self._outcomes.append((key, data, error))
            is_first = len(self._outcomes) == 1
        if is_first and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._settle)
            except RuntimeError:  # the loop is closed: nobody is left to tell
                pass

    def _settle(self) -> None:
        """(Event loop) report the outcomes of the writes the thread finished."""
        with self._lock:
            outcomes, self._outcomes = self._outcomes, []
        for key, data, error in outcomes:
            if error is None:
                if key in self._sizes and key not in self._pending:
                    self._on_written(key)
                continue
            self.num_failed_writes += 1
            if self._pending.get(key) is not data:
                continue  # removed (or removed and queued again) since: nothing of this write is advertised
            logger.error("ssd tier: writing %s failed: %s; the object is dropped", key.hex(), error)
            self.remove(key)
            self._on_dropped(key)
