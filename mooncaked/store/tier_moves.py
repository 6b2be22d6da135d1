"""Bytes between the store's DRAM pool and its SSD tier, in the order the metadata needs them.

1. Write-behind: `spill(pool, eviction)` (the core's spill) hands an evicted block's bytes to the SSD tier at
   once, inside the core call, before its pool space can be handed out again; False when the tier cannot take
   them (then the core keeps a pinned block in DRAM and drops an unpinned one).
2. Promotion: `promote(locations, place)` reads SSD-only blocks back and has `place` put each into DRAM (a
   block that failed stays on SSD); the result keeps the order.
3. Warm restart: `stop_ssd(pool, timeout_s)` queues every committed DRAM block SSD does not hold yet, most recently
   used first, ahead of the write-behind backlog, then lets the SSD writer work until the deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mooncaked.kv.store_core import TIER_DRAM, Eviction, Location, StoreCore
from mooncaked.store.shm_pool import ShmPool
from mooncaked.store.ssd import SsdTier

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TierMoves:
    """Owns nothing: the StoreService owns the core, the pool and the SSD tier, and passes the pool per call (it
    exists only between the service's start and stop)."""

    core: StoreCore
    ssd: SsdTier | None
    clock: Callable[[], float]

    def spill(self, pool: ShmPool | None, eviction: Eviction) -> bool:
        assert pool is not None and self.ssd is not None, "evictions happen only between start and stop"
        if self.ssd.put(eviction.key, pool.read(eviction.offset, eviction.num_bytes), self.clock()):
            return True
        logger.warning("store: ssd tier cannot take %s (budget or backlog full)", eviction.key.hex())
        return False

    async def promote(self, locations: Sequence[Location], place: Callable[[bytes, bytes], None]) -> list[Location]:
        """Bring SSD-only blocks back into DRAM; the result keeps the order (a block that failed stays SSD)."""
        result: list[Location] = []
        for location in locations:
            if location.tier != TIER_DRAM and self.ssd is not None:
                data = await self.ssd.get(location.key, self.clock())
                current = self.core.location(location.key)
                if data is not None and current is not None and current.tier != TIER_DRAM:
                    place(location.key, data)
            current = self.core.location(location.key)
            result.append(current if current is not None else location)
        return result

    async def stop_ssd(self, pool: ShmPool | None, timeout_s: float) -> None:
        """Write what DRAM holds to SSD for the next start (with a pool), then stop the SSD writer."""
        assert self.ssd is not None
        persisted = self._persist_dram(pool, timeout_s) if pool is not None else []
        started = time.monotonic()
        await asyncio.to_thread(self.ssd.stop, timeout_s)
        if persisted:
            num_lost = self.ssd.num_unwritten(persisted)
            logger.info("store: %d of %d DRAM blocks written to the ssd tier for the next start in %.2f s",
                        len(persisted) - num_lost, len(persisted), time.monotonic() - started)

    def _persist_dram(self, pool: ShmPool, timeout_s: float) -> list[bytes]:
        """Queue the DRAM blocks for SSD, most recently used first, writing from the pool (mapped until stop)."""
        assert self.ssd is not None
        locations = self.core.dram_blocks_by_recency()
        pool_view = pool.view
        blocks = [(loc.key, pool_view[loc.offset : loc.offset + loc.num_bytes]) for loc in locations]
        queued = self.ssd.persist(blocks, self.clock())
        if locations:
            num_bytes = sum(loc.num_bytes for loc in locations[: len(queued)])
            logger.info("store: writing %d of its %d DRAM blocks (%.1f MiB) to the ssd tier within %.1f s, most "
                        "recently used first", len(queued), len(locations), num_bytes / (1 << 20), timeout_s)
        return queued
