"""Room in the store's DRAM: allocation that evicts in the store's order when space or a tenant's share runs out.

1. The StoreCore builds one `DramEvictor` over its allocator, block table, eviction policy and tenant usage.
2. `allocate(num_bytes, protected, now, tenant)`: a tenant over its share first evicts its own blocks; then the
   allocator is tried, evicting one block at a time (unpinned first; a pinned block only when it can move to SSD,
   never a leased or protected one) until the bytes fit, else StoreFull.
3. `evict_to_watermark(now)` evicts from the high watermark down to the low one (kv/eviction.py).
4. Each eviction is queued: the service takes the queue with `drain()` and copies the bytes out to SSD before the
   space is handed out again. Nothing to stop: no task, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from mooncaked.kv.allocator import ExtentAllocator, OutOfSpace
from mooncaked.kv.block_table import BlockTable
from mooncaked.kv.eviction import blocks_to_free
from mooncaked.kv.replica_eviction import SpareFirstPolicy
from mooncaked.kv.store_types import TIER_DRAM, TIER_SSD, Eviction, StoreConfig, StoreFull
from mooncaked.kv.tenant_quota import TenantUsage


def _anyone(owner: str) -> bool:
    return True


class DramEvictor:
    """Owned by the StoreCore, whose allocator, block table, policy and tenant usage it changes only to evict.
    Owns the queue of evictions the service has not yet taken, and the eviction count."""

    def __init__(self, config: StoreConfig, allocator: ExtentAllocator, blocks: BlockTable,
                 policy: SpareFirstPolicy, tenants: TenantUsage, remove_block: Callable[[bytes], None]) -> None:
        blocks_to_free(0, 1, config.high_watermark, config.low_watermark)  # validates the watermarks
        self.config = config
        self.allocator = allocator
        self.blocks = blocks
        self.policy = policy
        self.tenants = tenants
        self._remove_block = remove_block  # a block gone from both tiers: its removal event is the core's
        self._evictions: list[Eviction] = []
        self.num_evicted = 0

    def allocate(self, num_bytes: int, protected: set[bytes], now: float, tenant: str = "") -> int:
        """DRAM offset of `num_bytes` for `tenant`, after what evictions it takes; never evicts `protected`."""
        capacity = self.allocator.capacity_bytes
        while self.tenants.is_over_share(tenant, num_bytes, capacity):  # its own blocks go first, room or not
            if not self._evict_one(protected, now, self.tenants.may_evict(tenant, num_bytes, capacity)):
                raise StoreFull(f"tenant {tenant} is at its pool_share of this store and holds nothing evictable")
        while True:
            try:
                return self.allocator.allocate(num_bytes)
            except OutOfSpace:
                if not self._evict_one(protected, now, self.tenants.may_evict(tenant, num_bytes, capacity)):
                    raise StoreFull(
                        f"store full: {num_bytes} bytes do not fit ({self.allocator.num_used_bytes} of "
                        f"{capacity} used, nothing evictable left)"
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
        """Evict one DRAM block (unpinned first; pinned ones only when they can go to SSD); bytes freed.
        `may_evict`: whose blocks this allocation may take (tenant shares)."""
        def is_evictable(key: Hashable) -> bool:
            block = self.blocks[key]  # type: ignore[index]
            return (block.num_readers == 0 and key not in protected and block.pinned_until <= now
                    and may_evict(block.tenant))

        victim = next(iter(self.policy.victims(is_evictable)), None)
        if victim is None and self.config.has_ssd:
            def is_movable(key: Hashable) -> bool:
                block = self.blocks[key]  # type: ignore[index]
                return block.num_readers == 0 and key not in protected and may_evict(block.tenant)
            victim = next(iter(self.policy.victims(is_movable)), None)
        if victim is None:
            return 0
        return self._evict(victim)  # type: ignore[arg-type]

    def _evict(self, key: bytes) -> int:
        block = self.blocks[key]
        assert block.dram_offset is not None and block.num_readers == 0
        self.policy.on_remove(key)
        is_to_ssd = self.config.has_ssd and not block.is_on_ssd
        self._evictions.append(Eviction(key, block.dram_offset, block.num_bytes, is_to_ssd))
        self.allocator.free(block.dram_offset, block.num_bytes)
        block.dram_offset = None
        self.num_evicted += 1
        self.tenants.add(block.tenant, TIER_DRAM, -block.num_bytes)
        if self.config.has_ssd:
            if not block.is_on_ssd:
                self.tenants.add(block.tenant, TIER_SSD, block.num_bytes)
            block.is_on_ssd = True  # optimistic: the service writes it behind; failures come back as ssd_dropped
        else:
            self._remove_block(key)
        return self.allocator.extent_bytes(block.num_bytes)

    def drain(self) -> list[Eviction]:
        """The evictions since the last call, oldest first; the service copies each out."""
        evictions, self._evictions = self._evictions, []
        return evictions
