import pytest

from mooncaked.kv.events import BLOCK_REMOVED, BLOCK_STORED
from mooncaked.kv.store_core import (
    TIER_DRAM, TIER_SSD, Eviction, Spill, StoreConfig, StoreCore, StoreFull, UnknownHandle,
)

UNIT = 4096


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def make_core(num_blocks: int = 10, spill: Spill | None = None, **overrides: object) -> StoreCore:
    settings: dict = {"capacity_bytes": num_blocks * UNIT, "high_watermark": 0.8, "low_watermark": 0.5,
                      "has_ssd": spill is not None}
    settings.update(overrides)
    return StoreCore(StoreConfig(**settings), spill)


class SsdStandIn:
    """Takes spilled blocks while it has room for `num_blocks` (the SSD tier's budget or backlog)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.taken: list[bytes] = []

    def __call__(self, eviction: Eviction) -> bool:
        if len(self.taken) >= self.num_blocks:
            return False
        self.taken.append(eviction.key)
        return True


def removed_keys(core: StoreCore, after_seq: int = 0) -> list[bytes]:
    return [e.key for e in core.events_after(after_seq) or [] if e.kind == BLOCK_REMOVED]


def put(core: StoreCore, keys: list[bytes], now: float = 0.0, first_position: int = 0) -> None:
    grants, _, _ = core.allocate(keys, UNIT, 1000, now, first_position)
    core.commit([g.handle_id for g in grants], now)


def test_allocate_then_commit_makes_keys_visible_and_publishes_events() -> None:
    core = make_core()
    grants, present, lease_id = core.allocate([key(1), key(2)], UNIT, 1000, 0.0)
    assert (present, lease_id) == ([], 0)
    assert core.lookup([key(1)], 0.0) == ([], 0)  # reserved, invisible
    assert core.commit([g.handle_id for g in grants], 0.0) == (2, 0)
    locations, _ = core.lookup([key(1), key(2), key(3)], 0.0)
    assert [(loc.key, loc.tier, loc.offset) for loc in locations] == [(g.key, TIER_DRAM, g.offset) for g in grants]
    assert [(e.seq, e.kind, e.key) for e in core.events_after(0) or []] == [
        (1, BLOCK_STORED, key(1)), (2, BLOCK_STORED, key(2))]


def test_committed_objects_are_immutable() -> None:
    core = make_core()
    put(core, [key(1)])
    offset = core.lookup([key(1)], 0.0)[0][0].offset
    grants, present, lease_id = core.allocate([key(1)], UNIT, 1000, 0.0)
    assert grants == [] and lease_id > 0  # no write handle for a present key: a read lease instead
    assert present[0].offset == offset


def test_two_writers_racing_on_one_key_first_commit_wins_and_duplicate_is_freed() -> None:
    core = make_core()
    first, _, _ = core.allocate([key(7)], UNIT, 1000, 0.0)
    second, _, _ = core.allocate([key(7)], UNIT, 1000, 0.0)
    assert first[0].offset != second[0].offset
    assert core.allocator.num_used_bytes == 2 * UNIT
    assert core.commit([second[0].handle_id], 0.0) == (1, 0)
    assert core.commit([first[0].handle_id], 0.0) == (0, 1)
    assert core.allocator.num_used_bytes == UNIT
    assert core.lookup([key(7)], 0.0)[0][0].offset == second[0].offset
    assert [e.kind for e in core.events_after(0) or []] == [BLOCK_STORED]  # one object, one event


def test_expired_write_lease_reclaims_space() -> None:
    core = make_core()
    grants, _, _ = core.allocate([key(1)], UNIT, 50, now=10.0)
    assert core.expire(10.04) == 0
    assert core.expire(10.05) == 1
    assert core.allocator.num_used_bytes == 0
    with pytest.raises(UnknownHandle, match="not outstanding"):
        core.commit([grants[0].handle_id], 10.06)


def test_leased_pinned_and_uncommitted_blocks_are_never_evicted() -> None:
    core = make_core(num_blocks=4, high_watermark=0.5, low_watermark=0.25)
    put(core, [key(1), key(2)])
    core.lookup([key(1)], 0.0, lease_ms=1000)  # read lease on key 1
    core.pin([key(2)], 1000, 0.0)
    core.allocate([key(3)], UNIT, 1000, 0.0)  # uncommitted
    assert core.evict_to_watermark(0.1) == 0
    with pytest.raises(StoreFull, match="store full"):
        core.allocate([key(4), key(5)], UNIT, 1000, 0.1)
    assert core.allocator.num_used_bytes == 3 * UNIT  # the failed allocation kept nothing
    assert [loc.key for loc in core.lookup([key(1), key(2)], 0.1)[0]] == [key(1), key(2)]


@pytest.mark.parametrize(
    ("policy", "expected_victims"),
    [("lru", [4, 5, 1]), ("lfu", [4, 5, 2]), ("length_aware", [5, 4, 1])],
)
def test_watermark_eviction_order_per_policy(policy: str, expected_victims: list[int]) -> None:
    core = make_core(num_blocks=10, eviction_policy=policy, high_watermark=0.5, low_watermark=0.2)
    put(core, [key(i) for i in range(1, 6)], now=1.0)  # positions 0..4
    for _ in range(3):
        core.lookup([key(1)], now=2.0)
    core.lookup([key(2)], now=3.0)
    core.lookup([key(3)], now=3.0)  # recency: 4 5 1 2 3; use counts: 1:4, 2:2, 3:2, 4:1, 5:1
    assert core.evict_to_watermark(4.0) == 3 * UNIT  # 5 blocks used >= 50%: free down to 2 blocks
    assert [e.kind for e in core.events_after(5) or []] == [BLOCK_REMOVED] * 3
    assert removed_keys(core, 5) == [key(i) for i in expected_victims]


def test_allocation_pressure_evicts_to_ssd_and_pins_move_not_drop() -> None:
    ssd = SsdStandIn(num_blocks=1)
    core = make_core(num_blocks=2, spill=ssd, high_watermark=1.0, low_watermark=1.0)
    put(core, [key(1), key(2)])
    core.pin([key(1), key(2)], 60_000, 0.0)
    put(core, [key(3)], now=1.0)
    assert ssd.taken == [key(1)]
    assert core.location(key(1)).tier == TIER_SSD  # type: ignore[union-attr]
    assert all(e.kind == BLOCK_STORED for e in core.events_after(0) or [])
    assert not core.is_ssd_evictable(key(1))  # pinned: the SSD tier keeps it


def test_a_pinned_block_the_ssd_tier_cannot_take_stays_and_the_allocation_fails() -> None:
    ssd = SsdStandIn(num_blocks=1)
    core = make_core(num_blocks=3, spill=ssd, high_watermark=1.0, low_watermark=1.0)
    put(core, [key(1), key(2), key(3)])
    core.pin([key(1), key(2)], 60_000, 0.0)
    put(core, [key(4)], now=1.0)  # key 3 (unpinned) goes to SSD first
    core.pin([key(4)], 60_000, 1.0)
    with pytest.raises(StoreFull, match="pinned and the SSD tier cannot take it"):
        put(core, [key(5)], now=2.0)  # the SSD tier is full: neither pinned block may go
    assert ssd.taken == [key(3)] and removed_keys(core) == []
    assert [loc.tier for loc in core.lookup([key(1), key(2), key(3), key(4)], 2.0)[0]] == [
        TIER_DRAM, TIER_DRAM, TIER_SSD, TIER_DRAM]
    core.unpin([key(1)])
    put(core, [key(5)], now=3.0)  # unpinned, key 1 may be dropped now that the SSD tier is full
    assert removed_keys(core) == [key(1)]


def test_promotion_places_ssd_block_back_in_dram() -> None:
    core = make_core(num_blocks=2, spill=SsdStandIn(num_blocks=4))
    core.ssd_loaded(key(9), UNIT)
    assert core.lookup([key(9)], 0.0)[0][0].tier == TIER_SSD
    offset = core.place_promoted(key(9), 0.0)
    assert offset is not None and core.location(key(9)).offset == offset  # type: ignore[union-attr]
    assert core.place_promoted(key(9), 0.0) is None  # already in DRAM
    core.ssd_dropped(key(9))
    assert core.location(key(9)) is not None  # still in DRAM


def test_pins_expire_with_their_ttl() -> None:
    core = make_core(num_blocks=4, high_watermark=0.5, low_watermark=0.25)
    put(core, [key(1), key(2)])
    assert core.pin([key(1), key(2), key(3)], ttl_ms=100, now=0.0) == [key(3)]
    assert core.is_pinned(key(1), 0.05)
    assert core.evict_to_watermark(0.05) == 0
    core.expire(0.2)
    assert not core.is_pinned(key(1), 0.2)
    assert core.evict_to_watermark(0.2) == UNIT
    assert core.unpin([key(2)]) == 0  # ttl already ran out


def test_read_leases_end_on_release_or_expiry() -> None:
    core = make_core(num_blocks=4, high_watermark=0.5, low_watermark=0.25)
    put(core, [key(1), key(2)])
    _, lease_a = core.lookup([key(1)], 0.0, lease_ms=1000)
    _, lease_b = core.lookup([key(2)], 0.0, lease_ms=100)
    assert core.evict_to_watermark(0.0) == 0
    assert core.release([lease_a, 999]) == 1
    core.expire(0.1)
    assert core.stats()["num_read_leases"] == 0
    assert core.evict_to_watermark(0.1) == UNIT


def test_bad_input_gives_clear_errors_and_loses_nothing() -> None:
    core = make_core()
    grants, _, _ = core.allocate([key(1), key(2)], UNIT, 1000, 0.0)
    with pytest.raises(ValueError, match=r"keys\[1\] must be 16 bytes"):
        core.allocate([key(3), b"short"], UNIT, 1000, 0.0)
    with pytest.raises(ValueError, match="lease_ms must be positive"):
        core.allocate([key(3)], UNIT, 0, 0.0)
    with pytest.raises(ValueError, match="distinct"):
        core.allocate([key(3), key(3)], UNIT, 1000, 0.0)
    with pytest.raises(UnknownHandle, match="handle 12345"):
        core.commit([grants[0].handle_id, 12345], 0.0)
    assert core.commit([g.handle_id for g in grants], 0.0) == (2, 0)  # the failed commit changed nothing
    with pytest.raises(UnknownHandle, match="already committed"):
        core.commit([grants[0].handle_id], 0.0)
    with pytest.raises(ValueError, match="stored with 4096 bytes"):
        core.allocate([key(1)], 2 * UNIT, 1000, 0.0)
    assert core.stats()["num_blocks"] == 2 and core.allocator.num_used_bytes == 2 * UNIT


def test_dump_is_consistent_with_event_sequence() -> None:
    core = make_core(num_blocks=4, max_events=2)
    put(core, [key(i) for i in range(4)])
    seq, keys = core.dump()
    assert seq == 4 and set(keys) == {key(i) for i in range(4)}
    assert core.events_after(1) is None and core.events_after(seq) == []


def test_spare_copies_are_evicted_first_and_marks_can_be_undone() -> None:
    core = make_core(num_blocks=10, high_watermark=0.5, low_watermark=0.2)
    for i in range(5):
        put(core, [key(i)], now=float(i))
    assert core.mark_spare([key(3), key(4), key(99)], []) == 2  # key 99 is not here: ignored
    assert core.mark_spare([], [key(4)]) == 1  # kept again (the other copy went away)
    assert core.stats()["num_spare_blocks"] == 1
    assert core.evict_to_watermark(5.0) == 3 * UNIT
    # LRU: the spare copy, then key 4 (kept again: first in line among the kept), then the oldest
    assert removed_keys(core, 5) == [key(3), key(4), key(0)]
    assert core.stats()["num_spare_blocks"] == 0


def test_spare_marks_reject_bad_keys_and_contradictions() -> None:
    core = make_core()
    put(core, [key(1)])
    with pytest.raises(ValueError, match="16 bytes"):
        core.mark_spare([b"short"], [])
    with pytest.raises(ValueError, match="both spare and kept"):
        core.mark_spare([key(1)], [key(1)])
    assert core.stats()["num_spare_blocks"] == 0
