"""Eviction policies: orders, non-evictable skipping, watermarks."""

import pytest

from mooncaked.kv.eviction import blocks_to_free, make_eviction_policy


def _drain(policy, is_evictable=lambda key: True):
    order = []
    for key in policy.victims(is_evictable):
        policy.on_remove(key)
        order.append(key)
    return order


def test_lru_evicts_least_recently_used_first():
    policy = make_eviction_policy("lru")
    for i, key in enumerate("abcd"):
        policy.on_insert(key, float(i), i)
    policy.on_access("a", 10.0, 0)
    assert _drain(policy) == ["b", "c", "d", "a"]
    assert len(policy) == 0


def test_lfu_evicts_least_frequent_first_ties_by_recency():
    policy = make_eviction_policy("lfu")
    for i, key in enumerate("abc"):
        policy.on_insert(key, float(i), 0)
    policy.on_access("a", 5.0, 0)
    policy.on_access("a", 6.0, 0)
    policy.on_access("c", 7.0, 0)
    # counts: a=3, b=1, c=2
    assert _drain(policy) == ["b", "c", "a"]


def test_length_aware_evicts_request_tail_first_then_older_requests():
    policy = make_eviction_policy("length_aware")
    for position, key in enumerate(["r1b0", "r1b1", "r1b2"]):
        policy.on_insert(key, 1.0, position)
    for position, key in enumerate(["r2b0", "r2b1"]):
        policy.on_insert(key, 2.0, position)
    assert _drain(policy) == ["r1b2", "r1b1", "r1b0", "r2b1", "r2b0"]


@pytest.mark.parametrize("name", ["lru", "lfu", "length_aware"])
def test_victims_skip_non_evictable_and_leave_them_resident(name):
    policy = make_eviction_policy(name)
    for i in range(6):
        policy.on_insert(i, float(i), 0)
    pinned = {0, 1, 2}
    assert _drain(policy, lambda key: key not in pinned) == [3, 4, 5]
    assert sorted(k for k in range(6) if k in policy) == [0, 1, 2]
    assert list(policy.victims(lambda key: False)) == []
    assert len(policy) == 3


@pytest.mark.parametrize("name", ["lru", "lfu", "length_aware"])
def test_victims_kept_by_caller_stay_resident(name):
    policy = make_eviction_policy(name)
    for i in range(3):
        policy.on_insert(i, float(i), 0)
    offered = list(policy.victims(lambda key: True))  # caller evicts nothing
    assert sorted(offered) == [0, 1, 2]
    assert len(policy) == 3 and all(k in policy for k in range(3))
    assert _drain(policy) == offered  # order unchanged relative to each other


def test_unknown_policy_lists_valid_names():
    with pytest.raises(ValueError, match="lru, lfu, length_aware"):
        make_eviction_policy("fifo")


def test_watermarks():
    assert blocks_to_free(79, 100, 0.8, 0.6) == 0
    assert blocks_to_free(80, 100, 0.8, 0.6) == 20
    assert blocks_to_free(100, 100, 0.9, 0.9) == 10
    with pytest.raises(ValueError, match="watermarks"):
        blocks_to_free(10, 100, 0.5, 0.7)


def test_many_pinned_keys_do_not_make_each_eviction_rescan():
    policy = make_eviction_policy("lru")
    for i in range(20000):
        policy.on_insert(i, 0.0, 0)
    pinned = set(range(10000))
    calls = 0

    def is_evictable(key):
        nonlocal calls
        calls += 1
        return key not in pinned

    for _ in range(100):
        victim = next(policy.victims(is_evictable))
        policy.on_remove(victim)
    assert calls < 10000 + 200  # the pinned front is scanned once, not once per eviction
