"""Replica-aware eviction: spare copies go first (pure: standard library only, time is a parameter).

A spare copy is a block that another store of the pool also holds, where the pool does not need both copies:
the conductor's `ReplicaTracker` (`mooncaked.sched.replicas`) decides which copies are spare and tells each store.

1. `ReplicaAwarePolicy(base)` keeps the base policy's order (`lru`, `lfu` or `length_aware`) within two groups and
   offers every spare copy before every kept one (a sole copy, the copy the pool keeps, a hot block's replica).
2. `mark_spare(key, is_spare)` moves a resident key between the groups. Its place within the new group follows
   from its own last use, use count and position: a mark is not a use.
3. With no marks at all (the paper's behaviour, `replication: always`) the order is exactly the base policy's.
"""

from __future__ import annotations

from collections.abc import Hashable

from mooncaked.kv.eviction import POLICY_NAMES, HeapPolicy

_SPARE, _KEPT = 0.0, 1.0


class ReplicaAwarePolicy(HeapPolicy):
    """Spare copies first, then the base order. Owns its spare set and use order besides the heap's state."""

    def __init__(self, base: str) -> None:
        if base not in POLICY_NAMES:
            raise ValueError(f"unknown eviction policy {base!r}; valid names: {', '.join(POLICY_NAMES)}")
        super().__init__()
        self.name = base
        self._spare: set[Hashable] = set()
        self._touch_order: dict[Hashable, int] = {}  # LRU: the order of uses among equal times
        self._num_touches = 0

    def _priority(self, key: Hashable) -> tuple[float, ...]:
        group = _SPARE if key in self._spare else _KEPT
        if self.name == "lfu":
            return (group, float(self._counts[key]), self._used_at[key])
        if self.name == "length_aware":
            return (group, self._used_at[key], -float(self._positions[key]))
        return (group, self._used_at[key], float(self._touch_order[key]))

    def on_insert(self, key: Hashable, now: float, position: int) -> None:
        self._touch(key)
        super().on_insert(key, now, position)

    def on_access(self, key: Hashable, now: float, position: int) -> None:
        if key in self:
            self._touch(key)
        super().on_access(key, now, position)

    def on_remove(self, key: Hashable) -> None:
        super().on_remove(key)
        self._spare.discard(key)
        self._touch_order.pop(key, None)

    def mark_spare(self, key: Hashable, is_spare: bool) -> bool:
        """Move a resident key into the spare group or out of it; False when it is not resident."""
        if key not in self:
            return False
        if is_spare != (key in self._spare):
            if is_spare:
                self._spare.add(key)
            else:
                self._spare.discard(key)
            self._push(key)
        return True

    def is_spare(self, key: Hashable) -> bool:
        return key in self._spare

    @property
    def num_spare(self) -> int:
        return len(self._spare)

    def _touch(self, key: Hashable) -> None:
        self._num_touches += 1
        self._touch_order[key] = self._num_touches
