"""The committed blocks of one store, with the read leases and pins on them: pure, `now` in seconds passed in.

1. `add(key, record)` makes a block present; `remove(key)` drops it, and from every lease that still names it.
2. `open_lease(keys, deadline, now)`: each block gains a reader until `release([lease_id])` or the deadline;
   a block with readers is never evicted or moved.
3. `pin(keys, until)` keeps blocks in DRAM (they only move to SSD) until `until`; `unpin(keys)` ends it.
4. `expire(now)` ends the leases and pins past their deadline.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

from mooncaked.kv.store_types import TIER_DRAM, TIER_SSD, BlockRecord, Location, ReadLease

logger = logging.getLogger(__name__)


class BlockTable:
    """Owns the block records and read leases of one store (owned by its StoreCore, which hands out the ids)."""

    def __init__(self) -> None:
        self._blocks: dict[bytes, BlockRecord] = {}
        self._leases: dict[int, ReadLease] = {}

    def __contains__(self, key: object) -> bool:
        return key in self._blocks

    def __getitem__(self, key: bytes) -> BlockRecord:
        return self._blocks[key]

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._blocks)

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, key: bytes) -> BlockRecord | None:
        return self._blocks.get(key)

    def records(self) -> Iterator[BlockRecord]:
        return iter(self._blocks.values())

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    def add(self, key: bytes, record: BlockRecord) -> None:
        assert key not in self._blocks
        self._blocks[key] = record

    def remove(self, key: bytes) -> None:
        block = self._blocks.pop(key)
        assert block.num_readers == 0 or block.dram_offset is None
        if block.pinned_until:
            logger.warning("pinned block %s dropped: no tier holds it any more", key.hex())
        if block.num_readers:
            for lease in self._leases.values():
                if key in lease.keys:
                    lease.keys.remove(key)

    def location(self, key: bytes) -> Location:
        block = self._blocks[key]
        if block.dram_offset is not None:
            return Location(key, TIER_DRAM, block.dram_offset, block.num_bytes)
        return Location(key, TIER_SSD, -1, block.num_bytes)

    # ---- read leases --------------------------------------------------------------------------------------
    def open_lease(self, lease_id: int, keys: Sequence[bytes], deadline: float, now: float) -> None:
        self._leases[lease_id] = ReadLease(list(keys), deadline)
        for key in keys:
            self._blocks[key].num_readers += 1
            self._blocks[key].last_used = now

    def release(self, lease_ids: Sequence[int]) -> int:
        """End read leases; ids no longer held are ignored. Returns the number ended."""
        num_released = 0
        for lease_id in lease_ids:
            lease = self._leases.pop(lease_id, None)
            if lease is not None:
                for key in lease.keys:
                    block = self._blocks.get(key)
                    if block is not None:
                        block.num_readers -= 1
                num_released += 1
        return num_released

    # ---- pins and expiry ----------------------------------------------------------------------------------
    def pin(self, keys: Sequence[bytes], until: float) -> list[bytes]:
        """Pin present keys until `until`; returns the keys that are not present (not pinned)."""
        for key in keys:
            block = self._blocks.get(key)
            if block is not None:
                block.pinned_until = max(block.pinned_until, until)
        return [key for key in keys if key not in self._blocks]

    def unpin(self, keys: Sequence[bytes]) -> int:
        num_unpinned = 0
        for key in keys:
            block = self._blocks.get(key)
            if block is not None and block.pinned_until:
                block.pinned_until = 0.0
                num_unpinned += 1
        return num_unpinned

    def is_pinned(self, key: bytes, now: float) -> bool:
        block = self._blocks.get(key)
        return block is not None and block.pinned_until > now

    def expire(self, now: float) -> None:
        """End the read leases and pins past their deadline."""
        self.release([lease_id for lease_id, lease in self._leases.items() if lease.deadline <= now])
        for block in self._blocks.values():
            if block.pinned_until and block.pinned_until <= now:
                block.pinned_until = 0.0

    def dram_by_recency(self) -> list[Location]:
        """Committed blocks in DRAM that SSD does not hold yet, most recently used first."""
        blocks = [(block.last_used, key) for key, block in self._blocks.items()
                  if block.dram_offset is not None and not block.is_on_ssd]
        blocks.sort(key=lambda item: item[0], reverse=True)
        return [self.location(key) for _, key in blocks]
