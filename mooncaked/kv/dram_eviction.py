"""Room in the store's DRAM: allocation that evicts in the store's order when space or a tenant's share runs out.

1. The StoreCore builds one `DramEvictor` over its allocator, block table, eviction policy and tenant usage, and
   with an SSD tier its `spill`, which takes an evicted block's bytes at once (store/service.py).
2. `allocate(num_bytes, protected, now, tenant)`: a tenant over its share first evicts its own blocks; then the
   allocator is tried, evicting one block at a time (unpinned first; a pinned block only when the SSD tier
   already holds it or takes it now, never a leased or protected one) until the bytes fit, else StoreFull.
   A pinned block never leaves every tier.
3. `evict_to_watermark(now)` evicts from the high watermark down to the low one (kv/eviction.py).
4. An unpinned block the SSD tier cannot take is dropped (its removal event is the core's). Nothing to stop: no
   task, no I/O of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from mooncaked.kv.allocator import ExtentAllocator, OutOfSpace
from mooncaked.kv.block_table import BlockTable
from mooncaked.kv.eviction import blocks_to_free
from mooncaked.kv.replica_eviction import SpareFirstPolicy
from mooncaked.kv.store_types import TIER_DRAM, TIER_SSD, Eviction, Spill, StoreConfig, StoreFull
from mooncaked.kv.tenant_quota import TenantUsage


def _anyone(owner: str) -> bool:
    return True


class DramEvictor:
    """Owned by the StoreCore, whose allocator, block table, policy and tenant usage it changes only to evict.
    Owns the eviction count."""

    def __init__(self, config: StoreConfig, allocator: ExtentAllocator, blocks: BlockTable,
                 policy: SpareFirstPolicy, tenants: TenantUsage, remove_block: Callable[[bytes], None],
                 spill: Spill | None) -> None:
        blocks_to_free(0, 1, config.high_watermark, config.low_watermark)  # validates the watermarks
        if config.has_ssd != (spill is not None):
            raise ValueError("a store with an SSD tier needs a spill, and only such a store")
        self.config = config
        self.allocator = allocator
        self.blocks = blocks
        self.policy = policy
        self.tenants = tenants
        self._remove_block = remove_block  # a block gone from both tiers: its removal event is the core's
        self._spill = spill
        self.num_evicted = 0

    def allocate(self, num_bytes: int, protected: set[bytes], now: float, tenant: str = "") -> int:
        """DRAM offset of `num_bytes` for `tenant`, after what evictions it takes; never evicts `protected`."""
        capacity = self.allocator.capacity_bytes
        while self.tenants.is_over_share(tenant, num_bytes, capacity):  # its own blocks go first, room or not
            if not self._evict_one(protected, now, self.tenants.may_evict(tenant, num_bytes, capacity)):
                raise StoreFull(f"tenant {tenant} is at its pool_share of this store and holds nothing evictable "
                                f"(its other blocks are leased, or pinned and the SSD tier cannot take them)")
        while True:
            try:
                return self.allocator.allocate(num_bytes)
            except OutOfSpace:
                if not self._evict_one(protected, now, self.tenants.may_evict(tenant, num_bytes, capacity)):
                    raise StoreFull(
                        f"store full: {num_bytes} bytes do not fit ({self.allocator.num_used_bytes} of "
                        f"{capacity} used, nothing evictable left: the rest is leased, being written, or pinned "
                        f"and the SSD tier cannot take it); retry later or unpin context caches"
                    ) from None

    def evict_to_watermark(self, now: float) -> int:
        """Evict from the high watermark down to the low one; returns bytes freed."""
        allocator = self.allocator
        num_to_free = blocks_to_free(allocator.num_used_bytes, allocator.capacity_bytes,
                                     self.config.high_watermark, self.config.low_watermark)
        num_freed = 0
        while num_freed < num_to_free:
            freed = self._evict_one(set(), now)
            if not freed:
                break
            num_freed += freed
        return num_freed

    def _evict_one(self, protected: set[bytes], now: float, may_evict: Callable[[str], bool] = _anyone) -> int:
        """Evict one DRAM block (unpinned first; pinned ones only to an SSD tier that holds or takes them); bytes
        freed. `may_evict`: whose blocks this allocation may take (tenant shares)."""
        def is_evictable(key: Hashable) -> bool:
            block = self.blocks[key]  # type: ignore[index]
            return (block.num_readers == 0 and key not in protected and block.pinned_until <= now
                    and may_evict(block.tenant))

        victim = next(iter(self.policy.victims(is_evictable)), None)
        if victim is not None:
            return self._evict(victim)  # type: ignore[arg-type]
        if self._spill is None:
            return 0

        def is_movable(key: Hashable) -> bool:
            block = self.blocks[key]  # type: ignore[index]
            return block.num_readers == 0 and key not in protected and may_evict(block.tenant)

        is_ssd_refusing = False
        for key in self.policy.victims(is_movable):
            block = self.blocks[key]  # type: ignore[index]
            if block.is_on_ssd:
                return self._evict(key)  # type: ignore[arg-type]
            if not is_ssd_refusing:
                assert block.dram_offset is not None
                if self._spill(Eviction(key, block.dram_offset, block.num_bytes)):  # type: ignore[arg-type]
                    return self._evict(key, is_spilled=True)  # type: ignore[arg-type]
                is_ssd_refusing = True  # then only copies SSD already holds may go
        return 0

    def _evict(self, key: bytes, is_spilled: bool = False) -> int:
        block = self.blocks[key]
        assert block.dram_offset is not None and block.num_readers == 0
        if self._spill is not None and not block.is_on_ssd and not is_spilled:
            is_spilled = self._spill(Eviction(key, block.dram_offset, block.num_bytes))
        self.policy.on_remove(key)
        self.allocator.free(block.dram_offset, block.num_bytes)
        block.dram_offset = None
        self.num_evicted += 1
        self.tenants.add(block.tenant, TIER_DRAM, -block.num_bytes)
        if is_spilled:
            self.tenants.add(block.tenant, TIER_SSD, block.num_bytes)
            block.is_on_ssd = True
        elif not block.is_on_ssd:
            self._remove_block(key)
        return self.allocator.extent_bytes(block.num_bytes)
