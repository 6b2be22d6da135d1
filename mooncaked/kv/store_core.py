"""The store's metadata and semantics (docs/design.md section 6): pure, synchronous, `now` in seconds passed in.

1. `allocate(keys, num_bytes, lease_ms, now)`: absent keys get write handles (space reserved, invisible);
   present keys get one read lease. All-or-nothing: if the absent keys do not fit after eviction, StoreFull.
2. `commit(handle_ids)`: the objects become visible (immutable from then on) and `BlockStored` is published.
   A key another writer committed first keeps the first object; the duplicate's space is freed. The writes in
   flight, from reservation to commit, abort or expiry, are kv/write_handles.py's `WriteHandles`.
3. `abort(handle_ids)` frees reserved space; `release(lease_ids)` ends read leases; `expire(now)` reclaims both
   when their lease runs out (a writer or reader that died), and unpins expired pins.
4. Eviction (`evict_to_watermark`, and on allocation pressure; kv/dram_eviction.py) follows the policy of
   `kv/eviction.py`, spare copies first (`mark_spare`: the conductor says another store keeps the block;
   `kv/replica_eviction.py`), and never touches a leased or uncommitted block; a pinned block only moves to an
   SSD tier that takes it, so it never leaves every tier. With an SSD tier the core is built with its `spill`,
   which takes an evicted block's bytes out of the pool before the space can be handed out again.
5. `lookup`, `pin`/`unpin`, `dump`, `stats`; the SSD tier reports what it wrote durably with `ssd_written` (only
   then does a block count as on SSD) and what it dropped (its own eviction, a failed write, a corrupt file) with
   `ssd_dropped`: a block no tier holds any more is removed with a `BlockRemoved` event.
6. `dram_blocks_by_recency()`: what a store stopping for a warm restart writes to SSD, most recently used first.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence

from mooncaked.kv.allocator import ExtentAllocator
from mooncaked.kv.block_table import BlockTable
from mooncaked.kv.dram_eviction import DramEvictor
from mooncaked.kv.events import BLOCK_REMOVED, BLOCK_STORED, EventLog, StoreEvent
from mooncaked.kv.replica_eviction import make_spare_first_policy
from mooncaked.kv.store_types import (
    TIER_DRAM,
    TIER_SSD,
    BlockRecord,
    Eviction,
    Grant,
    Location,
    Spill,
    StoreConfig,
    StoreFull,
    UnknownHandle,
    check_keys,
    check_lease_ms,
)
from mooncaked.kv.tenant_quota import TenantShare, TenantUsage
from mooncaked.kv.write_handles import WriteHandles

__all__ = ["TIER_DRAM", "TIER_SSD", "Eviction", "Grant", "Location", "Spill", "StoreConfig", "StoreCore",
           "StoreFull", "UnknownHandle", "check_keys"]


class StoreCore:
    """All metadata of one store. Owner: the `StoreService`; the allocator, policy, event log, the bytes per
    tenant, the DRAM evictor (dram_eviction.py) and the writes in flight (write_handles.py) are its own."""

    def __init__(self, config: StoreConfig, spill: Spill | None = None) -> None:
        self.config = config
        self.allocator = ExtentAllocator(config.capacity_bytes, config.alignment)
        self.policy = make_spare_first_policy(config.eviction_policy)  # the base order until a copy is marked spare
        self.events = EventLog(config.max_events)
        self.blocks = BlockTable()
        self.tenants = TenantUsage()
        self.dram = DramEvictor(config, self.allocator, self.blocks, self.policy, self.tenants, self._remove_block,
                                spill)
        self._ids = itertools.count(config.first_id)  # handles and read leases share it
        self.writes = WriteHandles(self.allocator, self.blocks, self.policy, self.events, self.tenants, self.dram,
                                   self._ids)
        self.num_hits = 0
        self.num_misses = 0

    # ---- writes -------------------------------------------------------------------------------------------
    def allocate(
        self, keys: Sequence[bytes], num_bytes: int, lease_ms: int, now: float, first_position: int = 0,
        tenant: str = "", share: TenantShare | None = None,
    ) -> tuple[list[Grant], list[Location], int]:
        """(write grants for absent keys, locations of present keys, read lease id or 0 if none present).
        `tenant` will own the new blocks, within `share` of the capacity (tenant_quota.py)."""
        check_keys(keys)
        self.tenants.state(tenant, share)
        check_lease_ms(lease_ms)
        if num_bytes <= 0:
            raise ValueError(f"num_bytes must be positive, got {num_bytes}")
        deadline = now + lease_ms / 1000.0
        present = [key for key in keys if key in self.blocks]
        for key in present:
            if self.blocks[key].num_bytes != num_bytes:
                raise ValueError(f"key {key.hex()} is stored with {self.blocks[key].num_bytes} bytes, not {num_bytes}")
        absent = [(first_position + i, key) for i, key in enumerate(keys) if key not in self.blocks]
        grants = self.writes.reserve(absent, num_bytes, deadline, now, protected=set(present), tenant=tenant)
        lease_id = self._open_read_lease(present, deadline, now) if present else 0
        return grants, [self._location(key) for key in present], lease_id

    def commit(self, handle_ids: Sequence[int], now: float) -> tuple[int, int]:
        """(number committed as new objects, number of duplicates freed). Validates all ids before changing any."""
        return self.writes.commit(handle_ids, now)

    def abort(self, handle_ids: Sequence[int]) -> int:
        """Free the space of outstanding handles; ids no longer outstanding are ignored. Returns the number freed."""
        return self.writes.abort(handle_ids)

    def place_promoted(self, key: bytes, now: float) -> int | None:
        """DRAM offset for an SSD-only block being promoted; the caller copies its bytes there at once.

        None when the key is no longer SSD-only (already promoted, or gone) or DRAM has no evictable room.
        """
        block = self.blocks.get(key)
        if block is None or block.dram_offset is not None:
            return None
        try:
            offset = self.dram.allocate(block.num_bytes, {key}, now)
        except StoreFull:
            return None
        block.dram_offset = offset
        block.last_used = now
        self.tenants.add(block.tenant, TIER_DRAM, block.num_bytes)
        self.policy.on_insert(key, now, block.position)
        return offset

    # ---- reads --------------------------------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes], now: float, lease_ms: int = 0) -> tuple[list[Location], int]:
        """(locations of the longest present prefix, read lease id on it or 0). `lease_ms` 0: no lease."""
        check_keys(keys)
        if lease_ms < 0:
            raise ValueError(f"lease_ms must be >= 0, got {lease_ms}")
        prefix: list[bytes] = []
        for key in keys:
            if key not in self.blocks:
                break
            prefix.append(key)
        self.num_hits += len(prefix)
        self.num_misses += len(keys) - len(prefix)
        for key in prefix:
            self.policy.on_access(key, now, self.blocks[key].position)
            self.blocks[key].last_used = now
        lease_id = self._open_read_lease(prefix, now + lease_ms / 1000.0, now) if prefix and lease_ms else 0
        return [self._location(key) for key in prefix], lease_id

    def release(self, lease_ids: Sequence[int]) -> int:
        """End read leases; ids no longer held are ignored. Returns the number ended."""
        return self.blocks.release(lease_ids)

    def location(self, key: bytes) -> Location | None:
        return self.blocks.location(key) if key in self.blocks else None

    # ---- pins ---------------------------------------------------------------------------------------------
    def pin(self, keys: Sequence[bytes], ttl_ms: int, now: float) -> list[bytes]:
        """Pin present keys until now + ttl; returns the keys that are not present (not pinned)."""
        check_keys(keys)
        if ttl_ms <= 0:
            raise ValueError(f"ttl_ms must be positive, got {ttl_ms}")
        return self.blocks.pin(keys, now + ttl_ms / 1000.0)

    def unpin(self, keys: Sequence[bytes]) -> int:
        check_keys(keys)
        return self.blocks.unpin(keys)

    def is_pinned(self, key: bytes, now: float) -> bool:
        return self.blocks.is_pinned(key, now)

    def mark_spare(self, spare_keys: Sequence[bytes], kept_keys: Sequence[bytes]) -> int:
        """Spare copies are evicted before every kept block; returns how many keys are in DRAM (the rest, gone
        since the conductor decided or only on SSD, are ignored)."""
        check_keys(spare_keys)
        check_keys(kept_keys)
        if set(spare_keys) & set(kept_keys):
            raise ValueError("a key cannot be both spare and kept in one call")
        num_marked = sum(1 for key in spare_keys if self.policy.mark_spare(key, True))
        return num_marked + sum(1 for key in kept_keys if self.policy.mark_spare(key, False))

    # ---- expiry, eviction and the SSD tier ------------------------------------------------------------------------------
    def expire(self, now: float) -> int:
        """Reclaim handles and read leases past their deadline; clear expired pins. Returns handles reclaimed."""
        num_expired = self.writes.expire(now)
        self.blocks.expire(now)
        return num_expired

    def evict_to_watermark(self, now: float) -> int:
        """Evict from the high watermark down to the low one; returns bytes freed."""
        return self.dram.evict_to_watermark(now)

    def ssd_dropped(self, key: bytes) -> None:
        """The SSD tier no longer holds `key` (its own eviction, a failed write or a corrupt file)."""
        block = self.blocks.get(key)
        if block is None or not block.is_on_ssd:
            return
        block.is_on_ssd = block.is_ssd_durable = False
        self.tenants.add(block.tenant, TIER_SSD, -block.num_bytes)
        if block.dram_offset is None:
            self._remove_block(key)

    def ssd_written(self, key: bytes) -> None:
        """The SSD tier's copy of `key` is on disk (written and fsync'd)."""
        block = self.blocks.get(key)
        if block is not None and block.is_on_ssd:
            block.is_ssd_durable = True

    def ssd_loaded(self, key: bytes, num_bytes: int) -> None:
        """A block found on SSD at start-up (after a restart) becomes present."""
        if key not in self.blocks:
            self.blocks.add(key, BlockRecord(num_bytes, None, True, 0, is_ssd_durable=True))
            self.tenants.add("", TIER_SSD, num_bytes)
            self.events.append(BLOCK_STORED, key)

    def dram_blocks_by_recency(self) -> list[Location]:
        """Committed blocks in DRAM that SSD does not hold yet, most recently used first."""
        return self.blocks.dram_by_recency()

    def is_ssd_evictable(self, key: Hashable) -> bool:
        block = self.blocks.get(key)  # type: ignore[arg-type]
        return block is None or (block.num_readers == 0 and block.pinned_until == 0.0)

    # ---- inspection ---------------------------------------------------------------------------------------
    def dump(self) -> tuple[int, list[bytes]]:
        """(sequence number of the last event, every present key), consistent with each other."""
        return self.events.last_seq, list(self.blocks)

    def events_after(self, seq: int, max_count: int = 4096) -> list[StoreEvent] | None:
        return self.events.events_after(seq, max_count)

    def stats(self) -> dict[str, int]:
        num_dram = sum(1 for b in self.blocks.records() if b.dram_offset is not None)
        return {
            "capacity_bytes": self.allocator.capacity_bytes,
            "used_bytes": self.allocator.num_used_bytes,
            "num_blocks": len(self.blocks),
            "num_dram_blocks": num_dram,
            "num_ssd_blocks": sum(1 for b in self.blocks.records() if b.is_ssd_durable),
            "num_ssd_writing": sum(1 for b in self.blocks.records() if b.is_on_ssd and not b.is_ssd_durable),
            "num_pending": len(self.writes),
            "num_read_leases": self.blocks.num_leases,
            "num_pinned": sum(1 for b in self.blocks.records() if b.pinned_until),
            "num_hits": self.num_hits,
            "num_misses": self.num_misses,
            "num_evicted": self.dram.num_evicted,
            "num_duplicates": self.writes.num_duplicates,
            "num_spare_blocks": self.policy.num_spare,
            "num_expired": self.writes.num_expired,
            "last_seq": self.events.last_seq,
        }

    # ---- internals ----------------------------------------------------------------------------------------
    def _remove_block(self, key: bytes) -> None:
        self.blocks.remove(key)
        self.events.append(BLOCK_REMOVED, key)

    def _open_read_lease(self, keys: list[bytes], deadline: float, now: float) -> int:
        lease_id = next(self._ids)
        self.blocks.open_lease(lease_id, keys, deadline, now)
        return lease_id

    def _location(self, key: bytes) -> Location:
        return self.blocks.location(key)
