"""The block cache: prefix hits, capacity, locked keys, hit rate."""

import pytest

from mooncaked.kv.block_cache import BlockCache
from mooncaked.kv.eviction import make_eviction_policy


def test_block_cache_prefix_hits_and_capacity():
    cache = BlockCache(make_eviction_policy("lru"), capacity=4)
    assert cache.access([1, 2, 3], now=0.0) == 0
    assert cache.access([1, 2, 9], now=1.0) == 2  # prefix 1, 2 hit; 9 inserted, 4 resident
    assert cache.num_hits == 2 and cache.num_lookups == 6
    cache.access([5, 6], now=2.0)  # evicts the two least recent: 3, then 1 (touched at 1.0 before 2 and 9)
    assert 3 not in cache and 5 in cache and 6 in cache and len(cache) == 4
    assert cache.match_prefix([1, 2]) == 0  # head evicted: the prefix is gone


def test_block_cache_never_evicts_locked_or_own_keys():
    cache = BlockCache(make_eviction_policy("lru"), capacity=3)
    cache.insert([1, 2, 3], now=0.0)
    cache.lock([1, 2])
    result = cache.insert([4, 5], now=1.0)  # only 3 can go: 4 fits, 5 does not
    assert result.evicted == [3] and result.inserted == [4]
    cache.unlock([1, 2])
    assert cache.remove(1) and not cache.remove(1)


def test_unbounded_cache_hit_rate_is_share_of_repeated_ids():
    requests = [[0, 1, 2], [0, 1, 3], [4], [0, 1, 3, 5]]
    cache = BlockCache(make_eviction_policy("length_aware"), capacity=None)
    for i, keys in enumerate(requests):
        cache.access(keys, float(i))
    assert cache.hit_rate == pytest.approx(5 / 11)
