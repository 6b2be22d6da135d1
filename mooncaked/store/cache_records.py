"""Context caches a store holds pinned (`POST /v1/caches`): which blocks each named cache keeps, and until when.

1. `put(cache, now)` records (or replaces) a cache whose every block the store holds; the caller pins its keys
   in the StoreCore until the cache's deadline.
2. `drop(cache_id)` forgets one; `expire(now)` forgets those past their deadline. Both return the dropped
   caches, whose keys the caller unpins and then pins again for the caches still holding them
   (`deadline_of`): a block shared by two caches stays pinned until the later one ends.
3. `live(now)` lists the caches for the conductors, who rebuild their listing from every store's.

Pure bookkeeping with `now` passed in (the store's monotonic clock); the wall-clock times the API shows travel
in `CacheInfo` untouched.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class CacheInfo:
    """What the API shows of a cache: set by the conductor that created it, kept verbatim by the stores."""

    cache_id: str
    owner: str  # the client id (digest of the API key) that created it; "" without API keys
    model: str
    num_tokens: int
    created_at: float  # unix seconds
    expires_at: float  # unix seconds


@dataclass(frozen=True)
class HeldCache:
    info: CacheInfo
    keys: tuple[bytes, ...]  # the context's full blocks, in order
    deadline: float  # store clock: when the pin ends


class CacheRecords:
    """Owns the store's cache records, by id (owned by the store's StoreCaches service)."""

    def __init__(self) -> None:
        self._caches: dict[str, HeldCache] = {}

    def __len__(self) -> int:
        return len(self._caches)

    def get(self, cache_id: str) -> HeldCache | None:
        return self._caches.get(cache_id)

    def put(self, cache: HeldCache) -> HeldCache | None:
        """Record `cache`; returns the record it replaced (same id), if any."""
        old = self._caches.get(cache.info.cache_id)
        self._caches[cache.info.cache_id] = cache
        return old

    def drop(self, cache_id: str) -> HeldCache | None:
        return self._caches.pop(cache_id, None)

    def expire(self, now: float) -> list[HeldCache]:
        expired = [cache for cache in self._caches.values() if cache.deadline <= now]
        for cache in expired:
            del self._caches[cache.info.cache_id]
        return expired

    def live(self, now: float) -> list[HeldCache]:
        return sorted((c for c in self._caches.values() if c.deadline > now), key=lambda c: c.info.created_at)

    def deadline_of(self, keys: Iterable[bytes]) -> dict[bytes, float]:
        """For each of `keys` that a recorded cache holds: the latest deadline among those caches."""
        wanted = set(keys)
        deadlines: dict[bytes, float] = {}
        for cache in self._caches.values():
            for key in wanted.intersection(cache.keys):
                deadlines[key] = max(deadlines.get(key, 0.0), cache.deadline)
        return deadlines
