"""Outages of one instance as the conductor sees them, and whether they add up to a crash loop.

1. `record(now)` on every up -> down transition (a worker's failed LOAD poll or request leg, a store's lost
   event stream).
2. `num_recent(now)` counts those within WINDOW_S; `is_crash_looping(now)` once that reaches CRASH_LOOP_OUTAGES:
   the instance keeps coming back and going down again (a supervisor or systemd restarting a crashing process).

Pure: `now` (time.monotonic) is passed in. Owned by the instance's state in the cluster view.
"""

from __future__ import annotations

from collections import deque

CRASH_LOOP_OUTAGES = 3
WINDOW_S = 300.0


class OutageHistory:
    """The times of one instance's most recent outages."""

    def __init__(self) -> None:
        self._times: deque[float] = deque(maxlen=CRASH_LOOP_OUTAGES)

    def record(self, now: float) -> None:
        self._times.append(now)

    def num_recent(self, now: float) -> int:
        return sum(1 for time in self._times if now - time <= WINDOW_S)

    def is_crash_looping(self, now: float) -> bool:
        return self.num_recent(now) >= CRASH_LOOP_OUTAGES
