"""How cold each store's coldest block is, as the conductor sees it (pure, `now` passed in).

Each store evicts by its own recency, so a store that takes in more than its share of new blocks evicts blocks
younger than one cache of the pool's size would, while another keeps older ones. With `scheduler.tie_break:
coldest_store`, Algorithm 1 sends a request that is equally fast on several instances (common: several are idle
and hold none of the prompt) to the one whose store's least recently used block was used longest ago, so the
stores' eviction ages even out.

1. The owner (the conductor's cluster view, or the simulator) creates `StoreRecency(index)`, which then listens to
   the shadow index, and calls `note_use(store_id, keys, now)` per placement: the prefill on that store's host
   touches or writes every block of the prompt there. A block not stored there yet counts from when it is.
2. `coldest_use(store_id)` is the oldest last use among the blocks the store holds (-inf when none): a min-heap
   of (used at, key) per store; entries of blocks used again or dropped since are skipped as they surface.
Blocks a store holds that no placement used there (a decode host's copies, a dump after a restart) do not count.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Hashable, Sequence

from mooncaked.sched.shadow_index import ShadowIndex

_MIN_PENDING = 4096  # pending blocks per store kept before old ones are pruned


class StoreRecency:
    """Last use per (store, block) and a lazy min-heap per store. Owner: the conductor (or the simulator); the
    shadow index stays its owner's."""

    def __init__(self, index: ShadowIndex) -> None:
        self.index = index
        self._used_at: dict[str, dict[Hashable, float]] = {}  # blocks the store holds
        self._pending: dict[str, dict[Hashable, float]] = {}  # used there, not stored there yet
        self._heaps: dict[str, list[tuple[float, int, Hashable]]] = {}
        self._seq = itertools.count()  # heap tie-break: keys need not be comparable
        index.add_listener(self._holders_changed)

    def note_use(self, store_id: str, keys: Sequence[Hashable], now: float) -> None:
        pending = self._pending.setdefault(store_id, {})
        for key in keys:
            if self.index.holds(store_id, key):
                self._set(store_id, key, now)
            else:
                pending[key] = now
        if len(pending) > len(self._used_at.get(store_id, ())) + _MIN_PENDING:
            self._prune_pending(store_id)

    def coldest_use(self, store_id: str) -> float:
        """When the store's least recently used block was last used; -inf when it holds no used block."""
        heap = self._heaps.get(store_id)
        used_at = self._used_at.get(store_id, {})
        while heap:
            at, _, key = heap[0]
            if used_at.get(key) == at:
                return at
            heapq.heappop(heap)
        return -math.inf

    def _set(self, store_id: str, key: Hashable, at: float) -> None:
        used_at = self._used_at.setdefault(store_id, {})
        heap = self._heaps.setdefault(store_id, [])
        used_at[key] = at
        heapq.heappush(heap, (at, next(self._seq), key))
        if len(heap) > 2 * len(used_at) + 1024:  # stale entries outnumber live ones: rebuild
            heap[:] = [(t, next(self._seq), k) for k, t in used_at.items()]
            heapq.heapify(heap)

    def _holders_changed(self, store_id: str, keys: Sequence[Hashable], is_stored: bool) -> None:
        if is_stored:
            pending = self._pending.get(store_id)
            for key in keys:
                at = pending.pop(key, None) if pending else None
                if at is not None:
                    self._set(store_id, key, at)
        else:
            used_at = self._used_at.get(store_id)
            if used_at:
                for key in keys:
                    used_at.pop(key, None)

    def _prune_pending(self, store_id: str) -> None:
        """Forget pending blocks older than everything the store holds (their prefill most likely failed), and
        the older half when that is not enough: memory stays O(blocks held + blocks of recent prompts)."""
        pending = self._pending[store_id]
        cutoff = self.coldest_use(store_id)
        kept = {key: at for key, at in pending.items() if at >= cutoff}
        if len(kept) > len(self._used_at.get(store_id, ())) + _MIN_PENDING:
            newest = sorted(kept.items(), key=lambda item: item[1])[len(kept) // 2:]
            kept = dict(newest)
        self._pending[store_id] = kept
