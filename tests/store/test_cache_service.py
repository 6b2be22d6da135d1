"""The store's named context caches: all-or-nothing pins, shared prefixes, expiry, loss (StoreCore, fake clock)."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncaked.kv.store_core import StoreConfig, StoreCore, StoreFull
from mooncaked.rpc import InvalidArgument
from mooncaked.rpc.protocol import Message, decode_message, encode_message
from mooncaked.store import cache_messages as m
from mooncaked.store.cache_service import StoreCaches

UNIT = 4096


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(num_blocks: int = 8) -> tuple[StoreCore, StoreCaches, Clock]:
    core = StoreCore(StoreConfig(capacity_bytes=num_blocks * UNIT, high_watermark=0.9, low_watermark=0.5))
    clock = Clock()
    return core, StoreCaches(core, clock, max_ttl_ms=3_600_000), clock


def put(core: StoreCore, keys: list[bytes], now: float) -> None:
    grants, _, _ = core.allocate(keys, UNIT, 1000, now)
    core.commit([g.handle_id for g in grants], now)


def info(cache_id: str, owner: str = "k1") -> m.CacheInfoMessage:
    return m.CacheInfoMessage(cache_id, owner, "tiny", 64, 1_700_000_000.0, 1_700_000_060.0)


async def pin(caches: StoreCaches, cache_id: str, keys: list[bytes], ttl_ms: int) -> m.CachePinReply:
    return await caches.pin(m.CachePinRequest(info(cache_id), keys, ttl_ms), None)


SAMPLES: list[Message] = [
    info("cache-1"),
    m.CachePinRequest(info("cache-1"), [key(1), key(2)], 60_000),
    m.CachePinReply(is_pinned=False, num_missing=2),
    m.CacheUnpinRequest("cache-1"),
    m.CacheUnpinReply(was_held=True),
    m.CacheListRequest(),
    m.CacheListReply([m.HeldCacheMessage(info("cache-1"), [key(1)], 5_000)]),
]


@pytest.mark.parametrize("message", SAMPLES, ids=lambda msg: type(msg).__name__)
def test_round_trip_through_msgpack(message: Message) -> None:
    wire = msgpack.unpackb(msgpack.packb(encode_message(message)), raw=False)
    assert decode_message(type(message), wire) == message


def test_methods_are_store_methods() -> None:
    names = [method.name for method in m.CACHE_METHODS]
    assert len(set(names)) == len(names) and all(name.startswith("store.cache_") for name in names)


async def test_pin_is_all_or_nothing_and_listed_with_its_keys() -> None:
    core, caches, clock = make()
    put(core, [key(1), key(2)], clock.now)
    assert await pin(caches, "c1", [key(1), key(2), key(3)], 60_000) == m.CachePinReply(False, 1)
    assert not core.is_pinned(key(1), clock.now) and not (await caches.list(m.CacheListRequest(), None)).caches
    assert (await pin(caches, "c1", [key(1), key(2)], 60_000)).is_pinned
    assert core.is_pinned(key(1), clock.now) and core.is_pinned(key(2), clock.now)
    [held] = (await caches.list(m.CacheListRequest(), None)).caches
    assert (held.info, held.keys, held.ttl_ms) == (info("c1"), [key(1), key(2)], 60_000)


async def test_expired_cache_is_unpinned_and_evictable() -> None:
    core, caches, clock = make(num_blocks=4)
    put(core, [key(1), key(2)], clock.now)
    assert (await pin(caches, "c1", [key(1), key(2)], 1_000)).is_pinned
    put(core, [key(3), key(4)], clock.now)
    with pytest.raises(StoreFull):  # pinned blocks are never evicted (and there is no SSD to move them to)
        core.allocate([key(5), key(6), key(7)], UNIT, 1000, clock.now)
    clock.now += 1.5
    assert not (await caches.list(m.CacheListRequest(), None)).caches
    assert not core.is_pinned(key(1), clock.now)
    core.allocate([key(5), key(6), key(7), key(8)], UNIT, 1000, clock.now)  # the whole pool: every block goes
    assert core.location(key(1)) is None and core.location(key(2)) is None


async def test_shared_prefix_stays_pinned_while_one_cache_holds_it() -> None:
    core, caches, clock = make()
    put(core, [key(1), key(2), key(3)], clock.now)
    assert (await pin(caches, "long", [key(1), key(2), key(3)], 10_000)).is_pinned
    assert (await pin(caches, "short", [key(1)], 60_000)).is_pinned
    assert (await caches.unpin(m.CacheUnpinRequest("long"), None)).was_held
    assert core.is_pinned(key(1), clock.now) and not core.is_pinned(key(2), clock.now)
    assert not (await caches.unpin(m.CacheUnpinRequest("long"), None)).was_held
    clock.now += 30.0  # a TTL shortened by pinning the id again
    assert (await pin(caches, "short", [key(1)], 1_000)).is_pinned
    clock.now += 2.0
    assert not core.is_pinned(key(1), clock.now) and not (await caches.list(m.CacheListRequest(), None)).caches


async def test_a_cache_that_lost_a_block_is_forgotten() -> None:
    core, caches, clock = make()
    put(core, [key(1), key(2)], clock.now)
    assert (await pin(caches, "c1", [key(1), key(2)], 60_000)).is_pinned
    core._remove_block(key(2))  # what dropping the block from every tier does
    assert not (await caches.list(m.CacheListRequest(), None)).caches
    assert not core.is_pinned(key(1), clock.now)


@settings(max_examples=60, deadline=None)
@given(ttl_ms=st.integers(-10, 10**10), keys=st.lists(st.binary(min_size=0, max_size=20), max_size=4),
       cache_id=st.text(max_size=8))
async def test_hostile_pin_requests_get_invalid_argument_or_a_clean_answer(ttl_ms: int, keys: list[bytes],
                                                                         cache_id: str) -> None:
    core, caches, clock = make()
    put(core, [key(1)], clock.now)
    try:
        reply = await caches.pin(m.CachePinRequest(info(cache_id), keys, ttl_ms), None)
    except InvalidArgument as exc:
        assert exc.message
        return
    assert 0 < ttl_ms <= 3_600_000 and cache_id and keys
    assert reply.is_pinned == (keys == [key(1)])
