"""The store's writes in flight, from reserved space to a visible block: pure, `now` in seconds passed in.

1. `reserve(absent, num_bytes, deadline, now, protected, tenant)`: each absent key gets DRAM space (the
   DramEvictor evicts for it, never a `protected` key) and a write handle, invisible to readers. The tenant is
   charged from the grant, so writes in flight count against its share. All-or-nothing: on StoreFull the handles
   reserved so far are aborted.
2. `commit(handle_ids, now)` checks every id before changing anything; each block becomes visible (immutable from
   then on) and `BlockStored` is published. A key another writer committed first keeps the first object and the
   duplicate's space is freed; a key present only on SSD takes this copy as its DRAM copy.
3. `abort(handle_ids)` frees reserved space; `expire(now)` aborts the handles past their deadline (a writer that
   died) with a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

from mooncaked.kv.allocator import ExtentAllocator
from mooncaked.kv.block_table import BlockTable
from mooncaked.kv.dram_eviction import DramEvictor
from mooncaked.kv.events import BLOCK_STORED, EventLog
from mooncaked.kv.replica_eviction import SpareFirstPolicy
from mooncaked.kv.store_types import TIER_DRAM, BlockRecord, Grant, PendingWrite, StoreFull, UnknownHandle
from mooncaked.kv.tenant_quota import TenantUsage

logger = logging.getLogger(__name__)


class WriteHandles:
    """Owned by the StoreCore, whose allocator, block table, policy, event log, tenant usage and DRAM evictor it
    changes only to reserve, commit and free writes, and whose id sequence it shares with the read leases.
    Owns the outstanding handles and the duplicate and expiry counts."""

    def __init__(self, allocator: ExtentAllocator, blocks: BlockTable, policy: SpareFirstPolicy, events: EventLog,
                 tenants: TenantUsage, dram: DramEvictor, ids: Iterator[int]) -> None:
        self.allocator = allocator
        self.blocks = blocks
        self.policy = policy
        self.events = events
        self.tenants = tenants
        self.dram = dram
        self._ids = ids
        self._pending: dict[int, PendingWrite] = {}
        self.num_duplicates = 0
        self.num_expired = 0

    def __len__(self) -> int:
        return len(self._pending)

    def reserve(self, absent: list[tuple[int, bytes]], num_bytes: int, deadline: float, now: float,
                protected: set[bytes], tenant: str = "") -> list[Grant]:
        """Write grants for the (position, key) pairs of `absent`, or StoreFull and none."""
        grants: list[Grant] = []
        try:
            for position, key in absent:
                offset = self.dram.allocate(num_bytes, protected, now, tenant)
                self.tenants.add(tenant, TIER_DRAM, num_bytes)  # counted from the grant: writes in flight too
                grant = Grant(next(self._ids), key, offset, num_bytes)
                self._pending[grant.handle_id] = PendingWrite(grant, deadline, position, tenant)
                grants.append(grant)
        except StoreFull:
            self.abort([grant.handle_id for grant in grants])
            raise
        return grants

    def commit(self, handle_ids: Sequence[int], now: float) -> tuple[int, int]:
        """(number committed as new objects, number of duplicates freed). Validates all ids before changing any."""
        self._check_handles(handle_ids)
        num_new = 0
        for handle_id in handle_ids:
            pending = self._pending.pop(handle_id)
            grant = pending.grant
            block = self.blocks.get(grant.key)
            if block is not None and block.dram_offset is not None:
                self.allocator.free(grant.offset, grant.num_bytes)  # another writer won: keep the first object
                self.tenants.add(pending.tenant, TIER_DRAM, -grant.num_bytes)
                self.num_duplicates += 1
                continue
            if block is None:
                block = BlockRecord(grant.num_bytes, grant.offset, False, pending.position, tenant=pending.tenant)
                self.blocks.add(grant.key, block)
                self.events.append(BLOCK_STORED, grant.key)
                num_new += 1
            else:  # present only on SSD: this copy becomes its DRAM copy, its owner's
                block.dram_offset = grant.offset
                self.tenants.add(pending.tenant, TIER_DRAM, -grant.num_bytes)
                self.tenants.add(block.tenant, TIER_DRAM, grant.num_bytes)
                self.num_duplicates += 1
            self.policy.on_insert(grant.key, now, pending.position)
            self.blocks[grant.key].last_used = now
        return num_new, len(handle_ids) - num_new

    def abort(self, handle_ids: Sequence[int]) -> int:
        """Free the space of outstanding handles; ids no longer outstanding are ignored. Returns the number freed."""
        num_freed = 0
        for handle_id in handle_ids:
            pending = self._pending.pop(handle_id, None)
            if pending is not None:
                self.allocator.free(pending.grant.offset, pending.grant.num_bytes)
                self.tenants.add(pending.tenant, TIER_DRAM, -pending.grant.num_bytes)
                num_freed += 1
        return num_freed

    def expire(self, now: float) -> int:
        """Abort the handles past their deadline; returns how many."""
        dead_handles = [handle_id for handle_id, p in self._pending.items() if p.deadline <= now]
        for handle_id in dead_handles:
            logger.warning("write handle %d for key %s expired before commit; space reclaimed",
                           handle_id, self._pending[handle_id].grant.key.hex())
        self.abort(dead_handles)
        self.num_expired += len(dead_handles)
        return len(dead_handles)

    def _check_handles(self, handle_ids: Sequence[int]) -> None:
        if len(set(handle_ids)) != len(handle_ids):
            raise ValueError("handle ids must be distinct within one commit")
        for handle_id in handle_ids:
            if handle_id not in self._pending:
                raise UnknownHandle(
                    f"handle {handle_id} is not outstanding (never issued, already committed or aborted, or its "
                    "lease expired); allocate again"
                )
