"""A capacity-bounded set of block keys under one eviction policy (pure: standard library only, `now` passed in).

The simulator's caches (the stores and the prefix-cache study) run it; the store itself keeps its own metadata.
1. `BlockCache(policy, capacity)`: empty; `capacity` None is unbounded.
2. Per request: `lookup(keys, now)` counts the prefix hit and marks the hit blocks used; `insert(keys, now,
   start)` makes the rest resident in order, evicting unlocked keys by the policy to make room (`access` does
   both); `touch` marks blocks used without hit accounting.
3. `lock`/`unlock` hold blocks in use (never evicted); `remove` drops an unlocked key.
"""

from __future__ import annotations

from collections.abc import Generator, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from mooncaked.kv.eviction import EvictionPolicy


@dataclass
class InsertResult:
    """What one `BlockCache.insert` changed: keys made resident and keys evicted to make room."""

    inserted: list[Hashable] = field(default_factory=list)
    evicted: list[Hashable] = field(default_factory=list)


class BlockCache:
    """A capacity-bounded set of block keys under one eviction policy, with prefix lookups and hit accounting.

    Owns the resident key set, the lock counts and the hit counters; the policy owns only the eviction order.
    Keys locked with `lock` (blocks in use) and the keys of the insert in progress are never evicted.
    """

    def __init__(self, policy: EvictionPolicy, capacity: int | None) -> None:
        if capacity is not None and capacity < 0:
            raise ValueError(f"capacity must be >= 0 or None (unbounded), got {capacity}")
        self.policy = policy
        self.capacity = capacity
        self._locks: dict[Hashable, int] = {}
        self.num_lookups = 0
        self.num_hits = 0

    def __len__(self) -> int:
        return len(self.policy)

    def __contains__(self, key: object) -> bool:
        return key in self.policy

    @property
    def hit_rate(self) -> float:
        return self.num_hits / self.num_lookups if self.num_lookups else 0.0

    def match_prefix(self, keys: Sequence[Hashable]) -> int:
        """Number of leading keys resident; changes nothing."""
        num_matched = 0
        for key in keys:
            if key not in self.policy:
                break
            num_matched += 1
        return num_matched

    def lookup(self, keys: Sequence[Hashable], now: float) -> int:
        """Prefix hit length; counts `len(keys)` lookups and the hits, and marks the hit blocks used."""
        num_matched = self.match_prefix(keys)
        for position in range(num_matched):
            self.policy.on_access(keys[position], now, position)
        self.num_lookups += len(keys)
        self.num_hits += num_matched
        return num_matched

    def insert(self, keys: Sequence[Hashable], now: float, start: int = 0) -> InsertResult:
        """Make keys[start:] resident in order, evicting others; stops at the first key that cannot fit."""
        result = InsertResult()
        num_missing = sum(1 for key in keys[start:] if key not in self.policy)
        num_room = self._make_room(num_missing, set(keys), result.evicted)
        for position in range(start, len(keys)):
            key = keys[position]
            if key in self.policy:
                self.policy.on_access(key, now, position)
                continue
            if num_room == 0:
                break
            num_room -= 1
            self.policy.on_insert(key, now, position)
            result.inserted.append(key)
        return result

    def access(self, keys: Sequence[Hashable], now: float) -> int:
        """A request in trace order: prefix lookup, then insert of the rest. Returns the prefix hit length."""
        num_matched = self.lookup(keys, now)
        self.insert(keys, now, start=num_matched)
        return num_matched

    def touch(self, keys: Iterable[Hashable], now: float, start: int = 0) -> None:
        """Marks resident keys used (no hit accounting); `start` is the position of the first key."""
        for position, key in enumerate(keys, start):
            if key in self.policy:
                self.policy.on_access(key, now, position)

    def remove(self, key: Hashable) -> bool:
        """Drop a resident, unlocked key; False when absent or locked."""
        if key not in self.policy or key in self._locks:
            return False
        self.policy.on_remove(key)
        return True

    def lock(self, keys: Iterable[Hashable]) -> None:
        for key in keys:
            self._locks[key] = self._locks.get(key, 0) + 1

    def unlock(self, keys: Iterable[Hashable]) -> None:
        for key in keys:
            count = self._locks[key] - 1
            if count:
                self._locks[key] = count
            else:
                del self._locks[key]

    def _make_room(self, num_needed: int, protected: set[Hashable], evicted: list[Hashable]) -> int:
        """Evict until `num_needed` keys fit (or nothing more can go); returns how many fit now."""
        if self.capacity is None:
            return num_needed
        num_free = self.capacity - len(self.policy)
        if num_free >= num_needed:
            return num_needed

        def is_evictable(key: Hashable) -> bool:
            return key not in protected and key not in self._locks

        candidates = self.policy.victims(is_evictable)
        try:
            for victim in candidates:
                self.policy.on_remove(victim)
                evicted.append(victim)
                num_free += 1
                if num_free >= num_needed:
                    break
        finally:
            if isinstance(candidates, Generator):
                candidates.close()  # heap policies requeue what they held back on close
        return max(0, min(num_free, num_needed))
