"""Replica-aware eviction: spare copies first, the base order within each group, marks are not uses."""

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mooncaked.kv.block_cache import BlockCache
from mooncaked.kv.eviction import make_eviction_policy
from mooncaked.kv.replica_eviction import make_spare_first_policy

POLICIES = ["lru", "lfu", "length_aware"]


def _drain(policy, is_evictable=lambda key: True):
    order = []
    for key in policy.victims(is_evictable):
        policy.on_remove(key)
        order.append(key)
    return order


@pytest.mark.parametrize("name", POLICIES)
def test_spare_copies_go_first_in_base_order(name):
    policy = make_spare_first_policy(name)
    for i, key in enumerate("abcdef"):
        policy.on_insert(key, float(i), 0)
    for key in "be":
        assert policy.mark_spare(key, True)
    assert policy.num_spare == 2 and policy.is_spare("e")
    assert _drain(policy) == ["b", "e", "a", "c", "d", "f"]


USES = st.lists(st.tuples(st.booleans(), st.integers(0, 40), st.integers(0, 7)), max_size=300)


@pytest.mark.parametrize("name", POLICIES)
@settings(max_examples=60, deadline=None)
@given(uses=USES)
def test_without_marks_the_order_is_the_base_policys(name, uses):
    """Property: any sequence of uses (many at one `now`, as one request's blocks are) drains in the base order."""
    aware, base = make_spare_first_policy(name), make_eviction_policy(name)
    now = 0.0
    for is_later, key, position in uses:
        now += 1.0 if is_later else 0.0
        for policy in (aware, base):
            if key in policy:
                policy.on_access(key, now, position)
            else:
                policy.on_insert(key, now, position)
    assert _drain(aware) == _drain(base)


def test_a_mark_is_not_a_use():
    policy = make_spare_first_policy("lru")
    for i, key in enumerate("abc"):
        policy.on_insert(key, float(i), 0)
    policy.mark_spare("a", True)
    policy.mark_spare("a", False)  # kept again: still the least recently used
    policy.mark_spare("c", True)
    policy.mark_spare("c", True)  # marking twice changes nothing
    assert _drain(policy) == ["c", "a", "b"]


def test_lru_moves_marked_keys_to_the_eviction_end_of_their_group():
    policy = make_spare_first_policy("lru")
    for i, key in enumerate("abcde"):
        policy.on_insert(key, float(i), 0)
    policy.mark_spare("d", True)
    policy.mark_spare("b", True)  # spare in the order marked
    policy.on_access("d", 9.0, 0)  # a use of a spare copy keeps it spare, now the most recent spare
    policy.mark_spare("e", True)
    policy.mark_spare("e", False)  # kept again: first of the kept in line, as cold as a copy can be
    assert _drain(policy) == ["b", "d", "e", "a", "c"]


def test_marks_on_absent_keys_and_removed_keys():
    policy = make_spare_first_policy("lru")
    assert not policy.mark_spare("x", True)
    policy.on_insert("x", 0.0, 0)
    policy.mark_spare("x", True)
    policy.on_remove("x")
    assert policy.num_spare == 0 and "x" not in policy
    policy.on_insert("x", 1.0, 0)  # back again: kept until marked
    assert not policy.is_spare("x")


def test_unknown_base_lists_valid_names():
    with pytest.raises(ValueError, match="lru, lfu, length_aware"):
        make_spare_first_policy("fifo")


@pytest.mark.parametrize("name", ["lfu", "length_aware"])
@settings(max_examples=60, deadline=None)
@example(ops=[("use", False, 1), ("use", False, 0), ("spare", False, 0), ("spare", False, 1)])  # ties, re-marked
@given(ops=st.lists(st.tuples(st.sampled_from(["use", "spare", "kept", "remove"]), st.booleans(),
                              st.integers(0, 40)), max_size=300))
def test_random_marks_keep_the_two_groups_in_base_order(name, ops):
    """Property over uses, marks and removals: the drain is every spare copy, then every kept one, each group in
    the order of a plain base policy that saw the same uses (the heap policies place a moved key by its own
    history; LRU's O(1) lists cannot, see the next test)."""
    aware, base = make_spare_first_policy(name), make_eviction_policy(name)
    now = 0.0
    for action, is_later, key in ops:
        now += 0.5 if is_later else 0.0
        if action == "use":
            for policy in (aware, base):
                if key in policy:
                    policy.on_access(key, now, key % 7)
                else:
                    policy.on_insert(key, now, key % 7)
        elif action == "remove":
            aware.on_remove(key)
            base.on_remove(key)
        else:
            assert aware.mark_spare(key, action == "spare") == (key in aware)
    spare = {key for key in range(41) if aware.is_spare(key)}
    base_order = _drain(base)
    assert _drain(aware) == [k for k in base_order if k in spare] + [k for k in base_order if k not in spare]


def test_block_cache_gives_spare_copies_back_before_sole_ones():
    policy = make_spare_first_policy("lru")
    cache = BlockCache(policy, capacity=4)
    cache.insert(["a0", "a1"], 1.0)
    cache.insert(["b0", "b1"], 2.0)
    policy.mark_spare("b0", True)
    policy.mark_spare("b1", True)
    cache.lock(["b1"])  # in use (a fetch reads it): never evicted, spare or not
    result = cache.insert(["c0", "c1"], 3.0)
    assert result.evicted == ["b0", "a0"]
    assert "b1" in cache and "a1" in cache
