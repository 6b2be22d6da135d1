"""SIEVE eviction order, visited bits, pinned entries."""

from __future__ import annotations

import pytest

from mooncaked.transfer.sieve import SieveCache


def test_unvisited_oldest_goes_first() -> None:
    cache: SieveCache[str, int] = SieveCache(3)
    for key in "abc":
        assert cache.put(key, 0) == []
    assert cache.put("d", 0) == [("a", 0)]
    assert [key for key, _ in cache.items()] == ["b", "c", "d"]


def test_visited_entries_survive_one_sweep() -> None:
    cache: SieveCache[str, int] = SieveCache(3)
    for key in "abc":
        cache.put(key, 0)
    cache.get("a")
    cache.get("b")
    assert cache.put("d", 0) == [("c", 0)], "hand clears a and b, evicts c"
    assert cache.put("e", 0) == [("d", 0)], "the hand kept its place; a and b are unvisited now but d comes first"
    cache.get("e")
    assert cache.put("f", 0) == [("a", 0)], "wrapped to the tail"


def test_entries_that_may_not_go_are_skipped_and_the_cap_is_soft() -> None:
    cache: SieveCache[str, int] = SieveCache(2)
    cache.put("busy", 1)
    cache.put("idle", 0)
    assert cache.put("new", 0, can_evict=lambda users: users == 0) == [("idle", 0)]
    assert cache.put("busy2", 1, can_evict=lambda users: users == 0) == [("new", 0)]
    assert cache.put("x", 0, can_evict=lambda users: users == 0) == [], "both in use: nothing may go"
    assert len(cache) == 3 and "x" in cache


def test_pop_and_capacity_check() -> None:
    cache: SieveCache[str, int] = SieveCache(2)
    cache.put("a", 1)
    assert cache.pop("a") == 1 and cache.pop("a") is None and len(cache) == 0
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        SieveCache(0)
