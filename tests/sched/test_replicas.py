"""Replica tracker: which copy is primary, when copies turn spare or kept, the replicate-or-not decision."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncaked.sched.replicas import BlockCosts, ReplicaTracker, pays_to_replicate
from mooncaked.sched.shadow_index import ShadowIndex
from mooncaked.sched.types import PolicyConfig

COSTS = BlockCosts(transfer_s=0.002, recompute_s=0.07)  # a fetch is 35x cheaper than a recompute


class Stores:
    """Two or more stores publishing sequenced events into one index."""

    def __init__(self, *names):
        self.index = ShadowIndex()
        self.seq = dict.fromkeys(names, 0)
        for name in names:
            self.index.apply_dump(name, 0, [])

    def store(self, name, keys):
        self.seq[name] += 1
        assert self.index.apply_stored(name, self.seq[name], keys)

    def remove(self, name, keys):
        self.seq[name] += 1
        assert self.index.apply_removed(name, self.seq[name], keys)


def _tracker(stores, **config):
    return ReplicaTracker(PolicyConfig(replication="by_reuse", **config), stores.index)


def _as_sets(marks):
    return {store: (sorted(m.spare), sorted(m.kept)) for store, m in marks.items()}


def test_replicate_or_not_weighs_saved_transfers_against_displaced_recompute():
    assert not pays_to_replicate(0.0, COSTS, 0.5)
    assert not pays_to_replicate(17.0, COSTS, 0.5)  # 17 x 2 ms < 0.5 x 70 ms
    assert pays_to_replicate(17.5, COSTS, 0.5)
    assert pays_to_replicate(0.0, COSTS, 0.0)  # displaced blocks never reused: replicas are free
    assert pays_to_replicate(1.0, BlockCosts(transfer_s=0.2, recompute_s=0.07), 0.5)  # a slow network


def test_a_fetched_copy_moves_the_primary_and_the_source_copy_turns_spare():
    stores = Stores("s1", "s2")
    tracker = _tracker(stores)
    stores.store("s1", ["a", "b"])
    tracker.note_use("s1", ["a", "b"], 0, now=0.0)
    assert tracker.take_marks(COSTS, 0.0) == {}
    tracker.note_use("s2", ["a", "b", "c"], 2, now=1.0)  # s2 fetches a, b from s1 and computes c
    assert tracker.take_marks(COSTS, 1.0) == {}  # s2 holds nothing yet: s1's copies stay kept
    stores.store("s2", ["a", "b", "c"])
    assert _as_sets(tracker.take_marks(COSTS, 2.0)) == {"s1": (["a", "b"], [])}
    assert tracker.primary("a") == "s2"


def test_reuse_where_a_spare_copy_lives_swaps_the_roles():
    stores = Stores("s1", "s2")
    tracker = _tracker(stores)
    stores.store("s1", ["a"])
    stores.store("s2", ["a"])
    tracker.note_use("s2", ["a"], 0, now=0.0)
    assert _as_sets(tracker.take_marks(COSTS, 0.0)) == {"s1": (["a"], [])}
    tracker.note_use("s1", ["a"], 1, now=5.0)  # a local hit on s1
    assert _as_sets(tracker.take_marks(COSTS, 5.0)) == {"s1": ([], ["a"]), "s2": (["a"], [])}


def test_the_last_copy_is_kept_again():
    stores = Stores("s1", "s2")
    tracker = _tracker(stores)
    stores.store("s1", ["a"])
    stores.store("s2", ["a"])
    tracker.note_use("s2", ["a"], 0, now=0.0)
    tracker.take_marks(COSTS, 0.0)
    stores.remove("s2", ["a"])  # the primary evicted its copy
    assert _as_sets(tracker.take_marks(COSTS, 1.0)) == {"s1": ([], ["a"])}
    stores.remove("s1", ["a"])
    assert tracker.take_marks(COSTS, 2.0) == {}


def test_hot_blocks_keep_every_copy_and_cool_down():
    stores = Stores("s1", "s2")
    tracker = _tracker(stores, heat_half_life_s=10.0)
    stores.store("s1", ["a"])
    stores.store("s2", ["a"])
    for i in range(20):
        tracker.note_use("s1" if i % 2 else "s2", ["a"], 1, now=float(i) * 0.01)
    assert tracker.heat("a", 0.2) == pytest.approx(20.0, rel=0.01)
    assert tracker.take_marks(COSTS, 0.2) == {}  # hot: both copies kept
    assert tracker.heat("a", 100.0) < 0.1
    tracker.note_use("s2", ["a"], 1, now=100.0)  # one more use, long after: a single copy pays now
    assert _as_sets(tracker.take_marks(COSTS, 100.0)) == {"s1": (["a"], [])}


def test_always_keeps_every_copy_and_tracks_nothing():
    stores = Stores("s1", "s2")
    tracker = ReplicaTracker(PolicyConfig(replication="always"), stores.index)
    stores.store("s1", ["a"])
    stores.store("s2", ["a"])
    tracker.note_use("s2", ["a"], 1, now=0.0)
    assert tracker.take_marks(COSTS, 0.0) == {} and tracker.primary("a") is None


def test_a_store_that_leaves_drops_its_marks_and_the_others_are_kept():
    stores = Stores("s1", "s2", "s3")
    tracker = _tracker(stores)
    for name in ("s1", "s2", "s3"):
        stores.store(name, ["a"])
    tracker.note_use("s3", ["a"], 0, now=0.0)
    assert _as_sets(tracker.take_marks(COSTS, 0.0)) == {"s1": (["a"], []), "s2": (["a"], [])}
    stores.index.remove_store("s3")  # unreachable: its keys leave the index
    assert _as_sets(tracker.take_marks(COSTS, 1.0)) == {"s1": ([], ["a"]), "s2": ([], ["a"])}


NAMES = ["s0", "s1", "s2", "s3"]
EVENTS = st.lists(st.tuples(st.sampled_from(["store", "remove", "use"]), st.sampled_from(NAMES),
                            st.lists(st.integers(0, 29), min_size=1, max_size=4, unique=True), st.integers(0, 4)),
                  max_size=200)


@settings(max_examples=100, deadline=None)
@given(events=EVENTS)
def test_random_events_keep_marks_consistent_with_the_rule(events):
    """Property over stores, removals and placements in any order: after each `take_marks`, the marks a store
    has received say spare exactly for its copies of non-hot blocks whose primary store holds them too, and
    every block the pool holds keeps at least one kept copy."""
    stores = Stores(*NAMES)
    tracker = _tracker(stores, heat_half_life_s=1.0)
    spare = {name: set() for name in NAMES}  # what each store was told
    now = 0.0
    for action, name, keys, num_reused in events:
        now += 0.05
        held = [k for k in keys if name in stores.index.holders(k)]
        if action == "store":
            stores.store(name, [k for k in keys if k not in held])
        elif action == "remove":
            stores.remove(name, held)
            spare[name].difference_update(held)  # an evicted copy loses its mark
        else:
            tracker.note_use(name, keys, min(num_reused, len(keys)), now)
        for store, marks in tracker.take_marks(COSTS, now).items():
            assert not set(marks.spare) & spare[store] and set(marks.kept) <= spare[store]
            spare[store] |= set(marks.spare)
            spare[store] -= set(marks.kept)
        for key in range(30):
            holders = stores.index.holders(key)
            primary = tracker.primary(key)
            hot = pays_to_replicate(tracker.heat(key, now), COSTS, 0.5)
            expected = {h for h in holders if primary in holders and h != primary and not hot}
            assert {h for h in holders if key in spare[h]} == expected
            assert not holders or any(key not in spare[h] for h in holders)


def test_forgets_blocks_no_store_holds_once_their_use_is_old():
    stores = Stores("s1")
    tracker = _tracker(stores, heat_half_life_s=1.0)
    tracker.note_use("s1", list(range(5000)), 0, now=0.0)  # placed, never stored (the prefill failed)
    tracker.take_marks(COSTS, 1.0)
    assert tracker.primary(0) == "s1"  # recent: the prefill may still be queued
    tracker.note_use("s1", list(range(5000, 11000)), 0, now=100.0)  # past the next sweep
    tracker.take_marks(COSTS, 100.0)
    assert tracker.primary(0) is None and tracker.primary(10999) == "s1"


def test_undone_marks_are_sent_again():
    stores = Stores("s1", "s2")
    tracker = _tracker(stores)
    stores.store("s1", ["a"])
    stores.store("s2", ["a"])
    tracker.note_use("s2", ["a"], 0, now=0.0)
    marks = tracker.take_marks(COSTS, 0.0)
    tracker.undo_marks("s1", marks["s1"])  # the call failed
    assert _as_sets(tracker.take_marks(COSTS, 1.0)) == {"s1": (["a"], [])}
    stores.remove("s2", ["a"])
    kept = tracker.take_marks(COSTS, 2.0)
    assert _as_sets(kept) == {"s1": ([], ["a"])}
    tracker.undo_marks("s1", kept["s1"])
    assert _as_sets(tracker.take_marks(COSTS, 3.0)) == {"s1": ([], ["a"])}


def test_a_copy_dropped_and_stored_again_between_rounds_is_marked_again():
    stores = Stores("s1", "s2")
    tracker = _tracker(stores)
    stores.store("s1", ["a"])
    stores.store("s2", ["a"])
    tracker.note_use("s2", ["a"], 0, now=0.0)
    assert _as_sets(tracker.take_marks(COSTS, 0.0)) == {"s1": (["a"], [])}
    stores.remove("s1", ["a"])  # evicted (its mark went with it) and stored again, both before the next round
    stores.store("s1", ["a"])
    assert _as_sets(tracker.take_marks(COSTS, 1.0)) == {"s1": (["a"], [])}
