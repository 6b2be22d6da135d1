"""Numbered batches of a device prefix cache's changes, so every conductor polling an instance learns the keys
its device tier gained and lost since its own last report (or, when it missed too much, all of them).

1. `record(gained, lost)` (the instance, before each report): the cache's drained changes become batch
   `seq + 1` (nothing when both are empty). At most `max_keys` keys are kept over all batches; older batches go.
2. `since(seq)`: the net (gained, lost) of the batches after `seq`, or None when the caller must take a full dump
   instead (seq < 0: it holds nothing; or batches it lacks were dropped; or seq is from before a restart: each
   incarnation starts its numbers at its own random `first_seq`, so an earlier one's numbers fall outside).

Pure: no I/O, no clock. Owner: the worker (roles/worker/kv/device_report.py reads it for LOAD replies).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence


# keys one LOAD reply carries at most (18 bytes each in msgpack: under 2 MB of the RPC's 4 MiB frames); the
# journal retains no more, and a dump of a bigger cache sends its newest keys (the conductor then underestimates
# the tier: a slower guess, never a wrong answer)
MAX_REPORTED_KEYS = 100_000


class DeviceCacheJournal:
    """Owns the retained change batches and the current sequence number. Owner: one instance's worker."""

    def __init__(self, max_keys: int, first_seq: int = 0) -> None:
        if max_keys <= 0 or first_seq < 0:
            raise ValueError(f"max_keys must be positive and first_seq >= 0, got {max_keys} and {first_seq}")
        self.max_keys = max_keys
        self.seq = first_seq
        self._batches: deque[tuple[int, list[Hashable], list[Hashable]]] = deque()
        self._num_keys = 0
        self._oldest = first_seq + 1  # the first batch still held (seq + 1 when none is)

    def record(self, gained: Sequence[Hashable], lost: Sequence[Hashable]) -> None:
        if not gained and not lost:
            return
        self.seq += 1
        self._batches.append((self.seq, list(gained), list(lost)))
        self._num_keys += len(gained) + len(lost)
        while self._num_keys > self.max_keys and self._batches:
            _, old_gained, old_lost = self._batches.popleft()
            self._num_keys -= len(old_gained) + len(old_lost)
        self._oldest = self._batches[0][0] if self._batches else self.seq + 1

    def since(self, seq: int) -> tuple[list[Hashable], list[Hashable]] | None:
        """Net (gained, lost) after `seq`; None: the caller needs a full dump."""
        if seq < self._oldest - 1 or seq > self.seq:
            return None
        gained: dict[Hashable, None] = {}
        lost: dict[Hashable, None] = {}
        for batch_seq, batch_gained, batch_lost in self._batches:
            if batch_seq <= seq:
                continue
            for key in batch_gained:
                if key in lost:  # lost, then gained again: the caller still has it
                    del lost[key]
                else:
                    gained[key] = None
            for key in batch_lost:
                if key in gained:  # gained, then lost: the caller never had it
                    del gained[key]
                else:
                    lost[key] = None
        return list(gained), list(lost)
