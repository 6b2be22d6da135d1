import pytest

from mooncaked.kv.events import BLOCK_REMOVED, BLOCK_STORED, EventLog


def test_sequence_numbers_are_gap_free_and_bounded() -> None:
    log = EventLog(max_events=4)
    for i in range(6):
        log.append(BLOCK_STORED if i % 2 == 0 else BLOCK_REMOVED, bytes([i]) * 16)
    assert log.last_seq == 6
    assert [e.seq for e in log.events_after(2) or []] == [3, 4, 5, 6]
    assert [e.seq for e in log.events_after(4, max_count=1) or []] == [5]
    assert log.events_after(6) == []
    assert log.events_after(1) is None  # event 2 was dropped: the subscriber must resync from a dump


def test_negative_seq_is_rejected() -> None:
    with pytest.raises(ValueError, match="seq"):
        EventLog(4).events_after(-1)
