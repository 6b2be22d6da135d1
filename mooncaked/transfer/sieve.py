"""SIEVE eviction (Zhang et al., NSDI'24) for the RDMA endpoint pool.

1. New keys enter at the head of a FIFO queue; a hit only sets the key's visited bit.
2. To evict, a hand walks from the tail towards the head: a visited key has its bit cleared and is passed over,
   the first unvisited key that may be evicted goes; the hand stays where it stopped, wrapping to the tail.

Pure data structure; not thread-safe (its owner holds a lock).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class SieveCache(Generic[K, V]):
    """Owns the key order, visited bits and values of at most `capacity` entries (soft when nothing may go)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._values: dict[K, V] = {}
        self._visited: dict[K, bool] = {}
        self._order: list[K] = []  # index 0 = tail (oldest), last = head (newest)
        self._hand = 0

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def get(self, key: K) -> V | None:
        value = self._values.get(key)
        if value is not None:
            self._visited[key] = True
        return value

    def put(self, key: K, value: V, can_evict: Callable[[V], bool] = lambda _: True) -> list[tuple[K, V]]:
        """Insert `key` (replacing its old value); returns what was evicted to make room."""
        evicted: list[tuple[K, V]] = []
        if key in self._values:
            self._values[key] = value
            self._visited[key] = True
            return evicted
        while len(self._order) >= self.capacity:
            victim = self._evict_one(can_evict)
            if victim is None:
                break
            evicted.append(victim)
        self._order.append(key)
        self._values[key] = value
        self._visited[key] = False
        return evicted

    def pop(self, key: K) -> V | None:
        if key not in self._values:
            return None
        index = self._order.index(key)
        del self._order[index]
        if index < self._hand:
            self._hand -= 1
        self._visited.pop(key)
        return self._values.pop(key)

    def items(self) -> list[tuple[K, V]]:
        return [(key, self._values[key]) for key in self._order]

    def _evict_one(self, can_evict: Callable[[V], bool]) -> tuple[K, V] | None:
        for _ in range(2 * len(self._order) + 1):  # two sweeps clear every bit once
            if self._hand >= len(self._order):
                self._hand = 0
            key = self._order[self._hand]
            if self._visited[key]:
                self._visited[key] = False
                self._hand += 1
            elif can_evict(self._values[key]):
                del self._order[self._hand]
                self._visited.pop(key)
                return key, self._values.pop(key)
            else:
                self._hand += 1
        return None
