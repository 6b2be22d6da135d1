"""Eviction policies (pure: standard library only, time is a parameter); block_cache.py bounds a key set with one.

Lifecycle of a key inside a policy:
1. `on_insert(key, now, position)` when the block becomes resident (`position` = its index within its request).
2. `on_access(key, now, position)` on every hit.
3. `victims(is_evictable)` yields candidates in eviction order; the caller evicts some of them and calls
   `on_remove(key)` for each one it drops (also for removals of its own, e.g. an explicit delete).

Policies (the paper's Table 1): `lru` (least recently used first), `lfu` (least frequently used first, ties by
recency) and `length_aware` (blocks later in their request first, ties by recency: a prefix's tail is the
part least likely to be shared). Keys are any hashables (16-byte block keys in the store, trace hash ids in
the simulator). Every operation is O(1) (LRU) or O(log n) amortised (heap-based policies).

Non-evictable keys met by `victims` get a second chance: they are requeued as if used at the latest `now`
seen, so that a front of leased or pinned blocks is not rescanned by every later call (CLOCK-style; amortised
O(1) per skip). A caller that stops consuming `victims` early should `close()` the iterator (dropping it does
the same in CPython): the heap-based policies hold the entries they offered until then.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Protocol

POLICY_NAMES = ("lru", "lfu", "length_aware")


class EvictionPolicy(Protocol):
    name: str

    def on_insert(self, key: Hashable, now: float, position: int) -> None: ...

    def on_access(self, key: Hashable, now: float, position: int) -> None: ...

    def on_remove(self, key: Hashable) -> None: ...

    def victims(self, is_evictable: Callable[[Hashable], bool]) -> Iterator[Hashable]: ...

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...


class LruPolicy:
    """Least recently used first. Owns only its recency order (an OrderedDict used as a linked list)."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def on_insert(self, key: Hashable, now: float, position: int) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: Hashable, now: float, position: int) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victims(self, is_evictable: Callable[[Hashable], bool]) -> Iterator[Hashable]:
        num_left = len(self._order)  # each key is offered at most once per call: no endless loop
        while num_left > 0 and self._order:
            num_left -= 1
            key = next(iter(self._order))
            if is_evictable(key):
                yield key
            if key in self._order:  # skipped, or offered and kept by the caller: second chance
                self._order.move_to_end(key)

    def make_least_recent(self, key: Hashable) -> None:
        """Put a resident key first in line for eviction (a key that is not resident is ignored)."""
        if key in self._order:
            self._order.move_to_end(key, last=False)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


class HeapPolicy:
    """Shared machinery: a min-heap of (priority, seq, key) with lazy deletion.

    `_rank` maps a key to its live (priority, seq); heap entries whose pair differs are stale. The heap is rebuilt
    when stale entries outnumber live ones, so memory stays O(live keys) and operations O(log n) amortised.
    """

    name = "heap"

    def __init__(self) -> None:
        self._rank: dict[Hashable, tuple[tuple[float, ...], int]] = {}
        self._heap: list[tuple[tuple[float, ...], int, Hashable]] = []
        self._seq = 0
        self._latest_now = -math.inf
        self._positions: dict[Hashable, int] = {}
        self._counts: dict[Hashable, int] = {}
        self._used_at: dict[Hashable, float] = {}

    def _priority(self, key: Hashable) -> tuple[float, ...]:
        raise NotImplementedError

    def _push(self, key: Hashable) -> None:
        self._seq += 1
        priority = self._priority(key)
        self._rank[key] = (priority, self._seq)
        heapq.heappush(self._heap, (priority, self._seq, key))
        if len(self._heap) > 2 * len(self._rank) + 1024:
            self._heap = [(p, s, k) for k, (p, s) in self._rank.items()]
            heapq.heapify(self._heap)

    def on_insert(self, key: Hashable, now: float, position: int) -> None:
        self._latest_now = max(self._latest_now, now)
        self._positions[key] = position
        self._counts[key] = 1
        self._used_at[key] = now
        self._push(key)

    def on_access(self, key: Hashable, now: float, position: int) -> None:
        if key not in self._rank:
            return
        self._latest_now = max(self._latest_now, now)
        self._counts[key] += 1
        self._used_at[key] = now
        self._push(key)

    def on_remove(self, key: Hashable) -> None:
        if self._rank.pop(key, None) is not None:
            del self._positions[key]
            del self._counts[key]
            del self._used_at[key]

    def victims(self, is_evictable: Callable[[Hashable], bool]) -> Iterator[Hashable]:
        offered: list[tuple[tuple[float, ...], int, Hashable]] = []  # restored unchanged unless removed
        skipped: list[Hashable] = []  # requeued as used at the latest `now` once this call ends
        try:
            while self._heap:
                entry = heapq.heappop(self._heap)
                priority, seq, key = entry
                if self._rank.get(key) != (priority, seq):
                    continue  # stale entry
                if is_evictable(key):
                    offered.append(entry)
                    yield key
                else:
                    skipped.append(key)
        finally:
            for priority, seq, key in offered:
                if self._rank.get(key) == (priority, seq):
                    heapq.heappush(self._heap, (priority, seq, key))
            for key in skipped:
                if key in self._rank:
                    self._used_at[key] = max(self._used_at[key], self._latest_now)
                    self._push(key)

    def __len__(self) -> int:
        return len(self._rank)

    def __contains__(self, key: object) -> bool:
        return key in self._rank


class LfuPolicy(HeapPolicy):
    """Least frequently used first (inserts + hits while resident), ties least recently used first."""

    name = "lfu"

    def _priority(self, key: Hashable) -> tuple[float, ...]:
        return (float(self._counts[key]), self._used_at[key])


class LengthAwarePolicy(HeapPolicy):
    """Least recently used first; among blocks used at the same `now`, later positions in the request first.

    Callers pass one `now` for all blocks of one request, so a cold prefix is evicted from its tail inwards and
    what stays resident is still a usable prefix (plain LRU over in-order touches evicts the head first, which
    strands the tail: it can never be matched again).
    """

    name = "length_aware"

    def _priority(self, key: Hashable) -> tuple[float, ...]:
        return (self._used_at[key], -float(self._positions[key]))


def make_eviction_policy(name: str) -> EvictionPolicy:
    """A fresh policy by name: "lru" | "lfu" | "length_aware"."""
    if name == "lru":
        return LruPolicy()
    if name == "lfu":
        return LfuPolicy()
    if name == "length_aware":
        return LengthAwarePolicy()
    raise ValueError(f"unknown eviction policy {name!r}; valid names: {', '.join(POLICY_NAMES)}")


def blocks_to_free(num_used: int, capacity: int, high_watermark: float, low_watermark: float) -> int:
    """Blocks to evict now: none below `high_watermark * capacity`, else down to `low_watermark * capacity`."""
    if not 0.0 < low_watermark <= high_watermark <= 1.0:
        raise ValueError(
            f"watermarks must satisfy 0 < low <= high <= 1, got low={low_watermark}, high={high_watermark}"
        )
    if capacity <= 0:
        raise ValueError(f"capacity must be positive, got {capacity}")
    if num_used < high_watermark * capacity:
        return 0
    return max(0, num_used - math.floor(low_watermark * capacity))
