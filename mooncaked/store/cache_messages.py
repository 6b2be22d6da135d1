"""The store's RPC messages for named context caches (issue 15; cache_records.py holds the records).

1. CACHE_PIN (conductor -> store): record cache `info` over `keys` and pin them for `ttl_ms`; all or nothing: a
   store lacking any key records nothing and says how many it lacks. Pinning an id again replaces its record
   (a new TTL: PATCH /v1/caches/{id}).
2. CACHE_UNPIN: forget a cache; its blocks stay pinned only as long as another cache holds them.
3. CACHE_LIST: every live cache with its keys; a conductor rebuilds its listing from every store's answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from mooncaked.rpc import Message, Method
from mooncaked.store.cache_records import CacheInfo, HeldCache


@dataclass(frozen=True)
class CacheInfoMessage(Message):
    cache_id: str
    owner: str
    model: str
    num_tokens: int
    created_at: float  # unix seconds
    expires_at: float  # unix seconds

    @classmethod
    def of(cls, info: CacheInfo) -> CacheInfoMessage:
        return cls(info.cache_id, info.owner, info.model, info.num_tokens, info.created_at, info.expires_at)

    def info(self) -> CacheInfo:
        return CacheInfo(self.cache_id, self.owner, self.model, self.num_tokens, self.created_at, self.expires_at)


@dataclass(frozen=True)
class CachePinRequest(Message):
    info: CacheInfoMessage
    keys: list[bytes]
    ttl_ms: int


@dataclass(frozen=True)
class CachePinReply(Message):
    is_pinned: bool
    num_missing: int  # keys this store lacks (nothing was pinned when > 0)


@dataclass(frozen=True)
class CacheUnpinRequest(Message):
    cache_id: str


@dataclass(frozen=True)
class CacheUnpinReply(Message):
    was_held: bool


@dataclass(frozen=True)
class CacheListRequest(Message):
    pass


@dataclass(frozen=True)
class HeldCacheMessage(Message):
    info: CacheInfoMessage
    keys: list[bytes]
    ttl_ms: int  # left, on the store's clock

    def held(self, now: float) -> HeldCache:
        return HeldCache(self.info.info(), tuple(self.keys), now + self.ttl_ms / 1000)


@dataclass(frozen=True)
class CacheListReply(Message):
    caches: list[HeldCacheMessage]


CACHE_PIN = Method("store.cache_pin", CachePinRequest, CachePinReply)
CACHE_UNPIN = Method("store.cache_unpin", CacheUnpinRequest, CacheUnpinReply)
CACHE_LIST = Method("store.cache_list", CacheListRequest, CacheListReply)

CACHE_METHODS = (CACHE_PIN, CACHE_UNPIN, CACHE_LIST)
