"""The device prefix cache's reports: whatever a conductor's polls see (replies lost, polls far apart, two
conductors), the keys its device index holds after an applied report are the cache's keys (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mooncaked.kv.device_cache import DevicePrefixCache
from mooncaked.kv.device_journal import DeviceCacheJournal
from mooncaked.sched.shadow_index import ShadowIndex

OPS = st.lists(st.one_of(st.tuples(st.just("insert"), st.integers(0, 30)), st.tuples(st.just("evict"),
                                                                                     st.integers(1, 4)),
                         st.tuples(st.just("poll"), st.integers(0, 1)), st.tuples(st.just("lost"), st.integers(0, 1))),
               max_size=80)


@settings(max_examples=200, deadline=None)
@given(OPS, st.integers(1, 12))
def test_applied_reports_mirror_the_cache(ops: list[tuple[str, int]], max_keys: int) -> None:
    cache, journal = DevicePrefixCache(), DeviceCacheJournal(max_keys)
    indexes = [ShadowIndex(), ShadowIndex()]
    next_page = 0

    def poll(index: ShadowIndex, is_lost: bool) -> None:
        sent = index.last_seq("p0")
        journal.record(*cache.drain_changes())
        changes = journal.since(sent)
        if is_lost:
            return
        if changes is None:
            index.apply_dump("p0", journal.seq, cache.keys())
        else:
            assert index.apply_changes("p0", sent, journal.seq, *changes)
        assert index.num_blocks("p0") == cache.num_cached
        assert all(index.holds("p0", key) for key in cache.keys())

    for op, arg in ops:
        if op == "insert":
            if cache.insert(f"k{arg}", next_page):
                next_page += 1
        elif op == "evict":
            cache.evict(arg)
        else:
            poll(indexes[arg], is_lost=op == "lost")
    for index in indexes:
        poll(index, is_lost=False)


def test_a_caller_behind_the_retained_batches_gets_a_dump() -> None:
    journal = DeviceCacheJournal(max_keys=2)
    journal.record(["a"], [])
    journal.record(["b"], [])
    assert journal.since(0) == (["a", "b"], [])
    journal.record(["c"], ["a"])
    assert journal.since(0) is None and journal.since(-1) is None and journal.since(9) is None
    assert journal.since(2) == (["c"], ["a"]) and journal.since(3) == ([], [])


def test_a_restarted_instance_s_numbers_do_not_meet_the_old_ones() -> None:
    restarted = DeviceCacheJournal(max_keys=8, first_seq=1_000)
    restarted.record(["x"], [])
    assert restarted.since(3) is None and restarted.since(-1) is None  # an earlier run's number: a dump
    assert restarted.since(1_000) == (["x"], [])
