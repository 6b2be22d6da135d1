"""The store's event log: `BlockStored` / `BlockRemoved` with a per-store sequence number.

1. The store core appends an event whenever a key becomes present (DRAM or SSD) or stops being present anywhere.
2. Sequence numbers start at 1 and have no gaps; the newest `max_events` are retained.
3. A subscriber reads `events_after(seq)`; when it fell behind the retained window it gets None and must resync
   from a dump (every present key plus the sequence number the dump is consistent with).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

BLOCK_STORED = "stored"
BLOCK_REMOVED = "removed"


@dataclass(frozen=True)
class StoreEvent:
    seq: int
    kind: str  # BLOCK_STORED | BLOCK_REMOVED
    key: bytes


class EventLog:
    """Bounded, gap-free event history. Owner: the `StoreCore`."""

    def __init__(self, max_events: int) -> None:
        if max_events <= 0:
            raise ValueError(f"max_events must be positive, got {max_events}")
        self._events: deque[StoreEvent] = deque(maxlen=max_events)
        self.last_seq = 0

    def append(self, kind: str, key: bytes) -> StoreEvent:
        assert kind in (BLOCK_STORED, BLOCK_REMOVED)
        self.last_seq += 1
        event = StoreEvent(self.last_seq, kind, key)
        self._events.append(event)
        return event

    @property
    def first_retained_seq(self) -> int:
        return self._events[0].seq if self._events else self.last_seq + 1

    def events_after(self, seq: int, max_count: int = 1 << 30) -> list[StoreEvent] | None:
        """Events with sequence numbers > `seq` (at most `max_count`); None when some were already dropped."""
        if seq < 0:
            raise ValueError(f"seq must be >= 0, got {seq}")
        if seq >= self.last_seq:
            return []
        if seq + 1 < self.first_retained_seq:
            return None
        num_new = self.last_seq - seq  # read from the newest end: subscribers are usually nearly caught up
        newest_first = list(itertools.islice(reversed(self._events), num_new))
        return newest_first[::-1][:max_count]
