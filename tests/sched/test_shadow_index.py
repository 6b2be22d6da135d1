"""Shadow index: events, gaps, resync, prefix lengths per store."""

from mooncaked.sched.shadow_index import ShadowIndex


def _index():
    index = ShadowIndex()
    index.apply_dump("s1", 0, [])
    index.apply_dump("s2", 0, [])
    return index


def test_prefix_lengths_per_store():
    index = _index()
    assert index.apply_stored("s1", 1, ["a", "b", "c"])
    assert index.apply_stored("s2", 1, ["a", "b", "x"])
    assert index.prefix_lengths(["a", "b", "c", "d"]) == {"s1": 3, "s2": 2}
    assert index.prefix_lengths(["b", "c"]) == {"s1": 2, "s2": 1}
    assert index.prefix_lengths(["z", "a"]) == {}
    assert index.prefix_lengths([]) == {}


def test_removed_events_and_holders():
    index = _index()
    index.apply_stored("s1", 1, ["a", "b"])
    index.apply_stored("s2", 1, ["a"])
    assert sorted(index.holders("a")) == ["s1", "s2"]
    assert index.apply_removed("s1", 2, ["a"])
    assert index.holders("a") == ["s2"]
    assert index.prefix_lengths(["a", "b"]) == {"s2": 1}
    assert index.num_keys == 2


def test_gap_marks_store_stale_until_dump():
    index = _index()
    index.apply_stored("s1", 1, ["a"])
    assert not index.apply_stored("s1", 3, ["b"])  # seq 2 was lost
    assert index.stale_stores() == {"s1"}
    assert "b" not in index.holders("b") and index.holders("b") == []
    assert not index.apply_stored("s1", 4, ["c"])  # still stale: ignored
    index.apply_dump("s1", 4, ["a", "b", "c"])
    assert index.stale_stores() == set()
    assert index.prefix_lengths(["a", "b", "c"]) == {"s1": 3}
    assert index.apply_stored("s1", 5, ["d"])


def test_duplicate_events_are_ignored():
    index = _index()
    index.apply_stored("s1", 1, ["a"])
    assert index.apply_stored("s1", 1, ["zzz"])  # redelivery of seq 1: not a gap, not applied
    assert index.holders("zzz") == []


def test_unknown_store_needs_dump_and_dump_replaces_contents():
    index = _index()
    assert not index.apply_stored("s9", 1, ["a"])
    assert "s9" in index.stale_stores()
    index.apply_stored("s2", 1, ["old"])
    index.apply_dump("s2", 7, ["new"])
    assert index.holders("old") == [] and index.holders("new") == ["s2"]
    index.remove_store("s2")
    assert index.holders("new") == [] and "s2" not in index.stores()


def test_many_stores_and_long_prompt():
    index = ShadowIndex()
    keys = list(range(300))
    for s in range(70):
        index.apply_dump(f"s{s}", 0, keys[: s * 4])
    lengths = index.prefix_lengths(keys)
    assert lengths == {f"s{s}": min(s * 4, 300) for s in range(1, 70)}


def test_listeners_hear_changes_per_store():
    index = _index()
    heard = []
    index.add_listener(lambda store, keys, is_stored: heard.append((store, sorted(keys), is_stored)))
    index.apply_stored("s1", 1, ["a", "b"])
    index.apply_stored("s2", 1, ["a"])
    index.apply_removed("s1", 2, ["zz", "a"])  # zz was never held: not a change
    index.apply_dump("s2", 5, ["c"])
    index.remove_store("s1")
    assert heard == [("s1", ["a", "b"], True), ("s2", ["a"], True), ("s1", ["a"], False), ("s2", ["a"], False),
                     ("s2", ["c"], True), ("s1", ["b"], False)]
    assert index.num_copies == 1 and index.has_key("c") and not index.has_key("a")
    assert index.holds("s2", "c") and not index.holds("s1", "c") and not index.holds("gone", "c")
