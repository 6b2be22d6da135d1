"""BlockTable: leases count readers, removal drops a block from its leases, expiry ends leases and pins."""

from mooncaked.kv.block_table import BlockTable
from mooncaked.kv.store_types import TIER_DRAM, TIER_SSD, BlockRecord, Location


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def table_of(num_blocks: int) -> BlockTable:
    table = BlockTable()
    for i in range(num_blocks):
        table.add(key(i), BlockRecord(64, i * 64, False, i))
    return table


def test_a_lease_counts_a_reader_until_released_or_expired() -> None:
    table = table_of(3)
    table.open_lease(7, [key(0), key(1)], deadline=10.0, now=1.0)
    table.open_lease(8, [key(1)], deadline=20.0, now=2.0)
    assert [table[key(i)].num_readers for i in range(3)] == [1, 2, 0]
    assert table[key(1)].last_used == 2.0
    assert table.release([7, 99]) == 1
    table.expire(now=20.0)
    assert [table[key(i)].num_readers for i in range(3)] == [0, 0, 0] and table.num_leases == 0


def test_a_removed_block_leaves_its_leases_and_the_others_stay_counted() -> None:
    table = table_of(2)
    table[key(0)].dram_offset = None  # only on SSD: it may go while read (its file is gone)
    table[key(0)].is_on_ssd = True
    table.open_lease(1, [key(0), key(1)], deadline=10.0, now=0.0)
    table.remove(key(0))
    assert key(0) not in table and table.release([1]) == 1 and table[key(1)].num_readers == 0


def test_pins_last_until_their_time_and_only_for_present_keys() -> None:
    table = table_of(2)
    assert table.pin([key(0), key(5)], until=5.0) == [key(5)]
    assert table.is_pinned(key(0), now=4.0) and not table.is_pinned(key(1), now=4.0)
    table.expire(now=5.0)
    assert not table.is_pinned(key(0), now=4.0)
    table.pin([key(1)], until=9.0)
    assert table.unpin([key(0), key(1)]) == 1


def test_locations_and_recency_order() -> None:
    table = table_of(3)
    table[key(2)].is_on_ssd = True
    table[key(0)].last_used, table[key(1)].last_used = 1.0, 2.0
    assert table.dram_by_recency() == [Location(key(1), TIER_DRAM, 64, 64), Location(key(0), TIER_DRAM, 0, 64)]
    table[key(2)].dram_offset = None
    assert table.location(key(2)) == Location(key(2), TIER_SSD, -1, 64)
