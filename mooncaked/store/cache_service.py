"""The store's named context caches over RPC: CACHE_PIN, CACHE_UNPIN, CACHE_LIST (cache_messages.py).

1. CACHE_PIN checks that the store holds every key of the cache, records it (`CacheRecords`) and pins the keys in
   the StoreCore until its deadline; pinning an id again replaces the record (its keys are pinned anew).
2. CACHE_UNPIN and expiry forget a record; its keys are unpinned, then pinned again until the latest deadline of
   any other cache holding them (a shared prefix stays pinned while one cache needs it).
3. CACHE_LIST answers the live caches. A cache one of whose blocks the store lost (dropped from every tier) is
   forgotten with a warning.
Every handler expires records first, on the store's clock; the StoreCore clears expired block pins by itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from mooncaked.kv.store_core import StoreCore
from mooncaked.kv.store_types import check_keys
from mooncaked.rpc import InvalidArgument
from mooncaked.store import cache_messages as msg
from mooncaked.store.cache_records import CacheRecords, HeldCache
from mooncaked.store.service import MethodRegistry

logger = logging.getLogger(__name__)


class StoreCaches:
    """Owns the store's cache records; borrows the StoreCore and the clock of the StoreService."""

    def __init__(self, core: StoreCore, clock: Callable[[], float], max_ttl_ms: int) -> None:
        self.core = core
        self.clock = clock
        self.max_ttl_ms = max_ttl_ms
        self.records = CacheRecords()

    def add_methods(self, server: MethodRegistry) -> None:
        server.add_method(msg.CACHE_PIN, self.pin, is_eager=True)
        server.add_method(msg.CACHE_UNPIN, self.unpin, is_eager=True)
        server.add_method(msg.CACHE_LIST, self.list, is_eager=True)

    async def pin(self, request: msg.CachePinRequest, ctx: object) -> msg.CachePinReply:
        if not 0 < request.ttl_ms <= self.max_ttl_ms:
            raise InvalidArgument(f"ttl_ms must be in 1..{self.max_ttl_ms}, got {request.ttl_ms}")
        if not request.keys or not request.info.cache_id:
            raise InvalidArgument("a cache needs an id and at least one key")
        try:
            check_keys(request.keys)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        now = self._expire()
        num_missing = sum(1 for key in request.keys if self.core.location(key) is None)
        if num_missing:
            return msg.CachePinReply(is_pinned=False, num_missing=num_missing)
        cache = HeldCache(request.info.info(), tuple(request.keys), now + request.ttl_ms / 1000)
        replaced = self.records.put(cache)
        if replaced is not None:
            self._repin(replaced.keys, now)
        self.core.pin(cache.keys, request.ttl_ms, now)
        return msg.CachePinReply(is_pinned=True, num_missing=0)

    async def unpin(self, request: msg.CacheUnpinRequest, ctx: object) -> msg.CacheUnpinReply:
        now = self._expire()
        dropped = self.records.drop(request.cache_id)
        if dropped is not None:
            self._repin(dropped.keys, now)
        return msg.CacheUnpinReply(was_held=dropped is not None)

    async def list(self, request: msg.CacheListRequest, ctx: object) -> msg.CacheListReply:
        now = self._expire()
        for cache in self.records.live(now):
            if any(self.core.location(key) is None for key in cache.keys):
                logger.warning("cache %s lost a block (dropped from every tier); forgetting it", cache.info.cache_id)
                self.records.drop(cache.info.cache_id)
                self._repin(cache.keys, now)
        return msg.CacheListReply([
            msg.HeldCacheMessage(msg.CacheInfoMessage.of(c.info), list(c.keys), max(int((c.deadline - now) * 1000), 1))
            for c in self.records.live(now)])

    def _expire(self) -> float:
        now = self.clock()
        for cache in self.records.expire(now):
            logger.info("cache %s expired; its blocks are evictable again", cache.info.cache_id)
            self._repin(cache.keys, now)
        return now

    def _repin(self, keys: Iterable[bytes], now: float) -> None:
        """Unpin `keys`, then pin each again until the latest deadline of the caches still holding it."""
        keys = [key for key in keys if self.core.location(key) is not None]
        self.core.unpin(keys)
        for key, deadline in self.records.deadline_of(keys).items():
            if deadline > now:
                self.core.pin([key], max(int((deadline - now) * 1000), 1), now)
