"""Progress of one weight load, logged at most every `interval_s` so only large checkpoints produce lines.

1. The loader creates a LoadProgress with the checkpoint's total bytes and the current time.
2. The weight iterator calls `advance(nbytes, now)` after each tensor; a line is logged when `interval_s`
   passed since the last one (the decision is `due_line`, pure over the counters and `now`).
3. `finish(now)` logs the summary (bytes, seconds, rate) once at the end.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

GIB = 1 << 30


class LoadProgress:
    """Bytes copied so far for one load; owned by the loading call (not shared between threads)."""

    def __init__(self, label: str, total_bytes: int, start: float, interval_s: float = 5.0) -> None:
        self.label = label
        self.total_bytes = total_bytes
        self.start = start
        self.interval_s = interval_s
        self.done_bytes = 0
        self.last_line_at = start

    def advance(self, nbytes: int, now: float) -> None:
        line = self.due_line(nbytes, now)
        if line is not None:
            logger.info("%s", line)

    def due_line(self, nbytes: int, now: float) -> str | None:
        """Count `nbytes` more; the progress line to log now, or None if the last one is recent."""
        self.done_bytes += nbytes
        if now - self.last_line_at < self.interval_s or self.done_bytes >= self.total_bytes:
            return None
        self.last_line_at = now
        percent = 100.0 * self.done_bytes / max(1, self.total_bytes)
        rate = self.done_bytes / GIB / max(now - self.start, 1e-9)
        return (f"loading {self.label}: {self.done_bytes / GIB:.2f} of {self.total_bytes / GIB:.2f} GiB "
                f"({percent:.0f}%), {rate:.2f} GiB/s")

    def finish(self, now: float) -> str:
        line = (f"loaded {self.label}: {self.done_bytes / GIB:.2f} GiB of weights in {now - self.start:.1f} s")
        logger.info("%s", line)
        return line
