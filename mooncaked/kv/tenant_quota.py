"""Pool shares per tenant in one store (pure: standard library only).

1. The tenant that writes a block owns it. `TenantUsage` counts the bytes each tenant's blocks hold in DRAM
   (from the write's grant, so writes in flight count) and on SSD, and remembers each tenant's shares as its writes
   last stated them (the stores learn tenants from the requests; no store reads the tenants file).
2. `may_evict(writer, num_bytes, capacity)` decides which blocks an allocation for `writer` may evict: a writer
   at or over its `pool_share` (counting this allocation) evicts only its own blocks; any other writer evicts
   anyone's except the blocks of a tenant at or below its `min_pool_share`.
3. The store makes a writer that `is_over_share` give back its own blocks first even when DRAM has free space,
   and refuses the allocation, naming the share, when nothing of its own is left to give back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class TenantShare:
    """A tenant's shares of a store's capacity: `pool_share` 0 means no cap."""

    pool_share: float = 0.0
    min_pool_share: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.pool_share <= 1.0 or not 0.0 <= self.min_pool_share <= 1.0:
            raise ValueError(f"shares must be in [0, 1], got pool_share {self.pool_share}, "
                             f"min_pool_share {self.min_pool_share}")


class TenantUsage:
    """Owns the bytes per tenant and tier and the shares last stated per tenant (owned by the StoreCore)."""

    def __init__(self) -> None:
        self.dram_bytes: dict[str, int] = {}
        self.ssd_bytes: dict[str, int] = {}
        self.shares: dict[str, TenantShare] = {}

    def state(self, tenant: str, share: TenantShare | None) -> None:
        if tenant and share is not None:
            self.shares[tenant] = share

    def add(self, tenant: str, tier: str, num_bytes: int) -> None:
        table = self.dram_bytes if tier == "dram" else self.ssd_bytes
        total = table.get(tenant, 0) + num_bytes
        if total > 0:
            table[tenant] = total
        else:
            table.pop(tenant, None)

    def is_over_share(self, tenant: str, num_bytes: int, capacity: int) -> bool:
        share = self.shares.get(tenant)
        if not tenant or share is None or share.pool_share <= 0:
            return False
        return self.dram_bytes.get(tenant, 0) + num_bytes > share.pool_share * capacity

    def is_protected(self, tenant: str, capacity: int) -> bool:
        share = self.shares.get(tenant)
        if not tenant or share is None or share.min_pool_share <= 0:
            return False
        return self.dram_bytes.get(tenant, 0) <= share.min_pool_share * capacity

    def may_evict(self, writer: str, num_bytes: int, capacity: int) -> Callable[[str], bool]:
        """Given a block's owner, whether this allocation may evict it."""
        if self.is_over_share(writer, num_bytes, capacity):
            return lambda owner: owner == writer
        return lambda owner: owner == writer or not self.is_protected(owner, capacity)
