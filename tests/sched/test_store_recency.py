"""Store recency: the last use of each store's coldest block, as placements and the shadow index tell it."""

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from mooncaked.sched.shadow_index import ShadowIndex
from mooncaked.sched.store_recency import StoreRecency


def test_coldest_block_follows_uses_stores_and_evictions():
    index = ShadowIndex()
    index.apply_dump("s1", 0, [])
    recency = StoreRecency(index)
    assert recency.coldest_use("s1") == -math.inf and recency.coldest_use("unknown") == -math.inf
    recency.note_use("s1", ["a", "b"], now=1.0)
    assert recency.coldest_use("s1") == -math.inf  # placed, not stored yet: nothing held
    index.apply_stored("s1", 1, ["a", "b"])  # the prefill committed them: they count from their use at t=1
    recency.note_use("s1", ["c"], now=2.0)
    index.apply_stored("s1", 2, ["c", "d"])  # d: stored without a placement using it here (not counted)
    assert recency.coldest_use("s1") == 1.0
    recency.note_use("s1", ["a", "b"], now=3.0)  # reused: c is the coldest now
    assert recency.coldest_use("s1") == 2.0
    index.apply_removed("s1", 3, ["c"])  # evicted
    assert recency.coldest_use("s1") == 3.0
    index.apply_stored("s1", 4, ["c"])  # back without a use here: not counted
    assert recency.coldest_use("s1") == 3.0


@settings(max_examples=100, deadline=None)
@given(steps=st.lists(st.tuples(st.booleans(), st.sampled_from(["s1", "s2"]),
                                st.lists(st.integers(0, 60), min_size=1, max_size=5, unique=True)), max_size=300))
def test_placements_and_evictions_match_a_brute_force_minimum(steps):
    """Property: after placements (a use, then the absent blocks stored) and evictions on two stores in any order,
    the answer is the minimum last use over the blocks each store holds; the heaps stay bounded."""
    index = ShadowIndex()
    seqs = {"s1": 0, "s2": 0}
    for store in seqs:
        index.apply_dump(store, 0, [])
    recency = StoreRecency(index)
    last_use: dict[tuple[str, int], float] = {}
    for step, (is_placement, store, keys) in enumerate(steps):
        now = float(step)
        seqs[store] += 1
        if is_placement:
            recency.note_use(store, keys, now)
            index.apply_stored(store, seqs[store], [k for k in keys if not index.holds(store, k)])
            last_use.update({(store, key): now for key in keys})
        else:
            index.apply_removed(store, seqs[store], keys)
        for name in seqs:
            held = [at for (s, key), at in last_use.items() if s == name and index.holds(name, key)]
            assert recency.coldest_use(name) == (min(held) if held else -math.inf)
    assert all(len(heap) <= 2 * 61 + 1024 for heap in recency._heaps.values())


def test_pending_blocks_of_failed_prefills_are_forgotten():
    index = ShadowIndex()
    index.apply_dump("s1", 0, ["held"])
    recency = StoreRecency(index)
    recency.note_use("s1", ["held"], now=100.0)
    recency.note_use("s1", list(range(5000)), now=1.0)  # placed long ago and never stored
    recency.note_use("s1", list(range(5000, 5200)), now=200.0)  # past the bound: the stale ones go
    assert len(recency._pending["s1"]) == 200
    index.apply_stored("s1", 1, [5000])
    assert recency.coldest_use("s1") == 100.0
