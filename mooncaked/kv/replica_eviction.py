"""Replica-aware eviction: spare copies go first (pure: standard library only, time is a parameter).

A spare copy is a block that another store of the pool also holds, where the pool does not need both copies:
the conductor's `ReplicaTracker` (`mooncaked.sched.replicas`) decides which copies are spare and tells each store.

1. `make_spare_first_policy(base)` gives a policy that keeps the base order (`lru`, `lfu` or `length_aware`)
   within two groups and offers every spare copy before every kept one (a sole copy, the copy the pool keeps,
   a hot block's replica).
2. `mark_spare(key, is_spare)` moves a resident key between the groups; a mark is not a use. The heap policies
   (`lfu`, `length_aware`) place it by its own counts, last use and position. LRU keeps O(1) linked lists and no
   timestamps, so a key marked spare joins the spare group as its most recent member and a key kept again joins
   the kept group as its least recent one (it was spare because another copy was the one in use).
3. With no marks at all (the paper's behaviour, `replication: always`) the order is exactly the base policy's.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Protocol

from mooncaked.kv.eviction import POLICY_NAMES, HeapPolicy, LruPolicy

_SPARE, _KEPT = 0.0, 1.0


class SpareFirstPolicy(Protocol):
    """An `EvictionPolicy` that also takes spare marks."""

    name: str

    def on_insert(self, key: Hashable, now: float, position: int) -> None: ...

    def on_access(self, key: Hashable, now: float, position: int) -> None: ...

    def on_remove(self, key: Hashable) -> None: ...

    def victims(self, is_evictable: Callable[[Hashable], bool]) -> Iterator[Hashable]: ...

    def mark_spare(self, key: Hashable, is_spare: bool) -> bool: ...

    def is_spare(self, key: Hashable) -> bool: ...

    @property
    def num_spare(self) -> int: ...

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...


def make_spare_first_policy(base: str) -> SpareFirstPolicy:
    """Spare copies first, then `base` ("lru" | "lfu" | "length_aware")."""
    if base not in POLICY_NAMES:
        raise ValueError(f"unknown eviction policy {base!r}; valid names: {', '.join(POLICY_NAMES)}")
    return SpareFirstLru() if base == "lru" else SpareFirstHeap(base)


class SpareFirstLru:
    """Two LRU lists, spare copies then kept ones. Owns only the two orders."""

    name = "lru"

    def __init__(self) -> None:
        self._kept = LruPolicy()
        self._spare = LruPolicy()

    def on_insert(self, key: Hashable, now: float, position: int) -> None:
        self._spare.on_remove(key)
        self._kept.on_insert(key, now, position)

    def on_access(self, key: Hashable, now: float, position: int) -> None:
        self._kept.on_access(key, now, position)
        self._spare.on_access(key, now, position)

    def on_remove(self, key: Hashable) -> None:
        self._kept.on_remove(key)
        self._spare.on_remove(key)

    def victims(self, is_evictable: Callable[[Hashable], bool]) -> Iterator[Hashable]:
        yield from self._spare.victims(is_evictable)
        yield from self._kept.victims(is_evictable)

    def mark_spare(self, key: Hashable, is_spare: bool) -> bool:
        """Move a resident key into the spare group or out of it; False when it is not resident."""
        source, target = (self._kept, self._spare) if is_spare else (self._spare, self._kept)
        if key in source:
            source.on_remove(key)
            target.on_insert(key, 0.0, 0)
            if not is_spare:
                target.make_least_recent(key)
        return key in target

    def is_spare(self, key: Hashable) -> bool:
        return key in self._spare

    @property
    def num_spare(self) -> int:
        return len(self._spare)

    def __len__(self) -> int:
        return len(self._kept) + len(self._spare)

    def __contains__(self, key: object) -> bool:
        return key in self._kept or key in self._spare


class SpareFirstHeap(HeapPolicy):
    """LFU or length-aware order with the group in front of the priority. Owns its spare set besides the heap."""

    def __init__(self, base: str) -> None:
        assert base in ("lfu", "length_aware"), base
        super().__init__()
        self.name = base
        self._spare: set[Hashable] = set()

    def _priority(self, key: Hashable) -> tuple[float, ...]:
        group = _SPARE if key in self._spare else _KEPT
        if self.name == "lfu":
            return (group, float(self._counts[key]), self._used_at[key])
        return (group, self._used_at[key], -float(self._positions[key]))

    def on_remove(self, key: Hashable) -> None:
        super().on_remove(key)
        self._spare.discard(key)

    def mark_spare(self, key: Hashable, is_spare: bool) -> bool:
        """Move a resident key into the spare group or out of it; False when it is not resident."""
        if key not in self:
            return False
        if is_spare != (key in self._spare):
            if is_spare:
                self._spare.add(key)
            else:
                self._spare.discard(key)
            self._requeue(key)
        return True

    def _requeue(self, key: Hashable) -> None:
        """Its group changed, not its use: it keeps its sequence number, so ties break as in the base policy."""
        _, seq = self._rank[key]
        priority = self._priority(key)
        self._rank[key] = (priority, seq)
        heapq.heappush(self._heap, (priority, seq, key))

    def is_spare(self, key: Hashable) -> bool:
        return key in self._spare

    @property
    def num_spare(self) -> int:
        return len(self._spare)
