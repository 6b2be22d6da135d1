"""Path health: which paths (a TCP connection, an RDMA NIC pair) may carry slices now.

1. Every failure on a path is counted; a success resets the count.
2. After `failure_threshold` consecutive failures the path cools down for `cooldown_s` and is avoided.
3. When the cooldown ends the path is usable again; its next failure starts a new cooldown at once.

Pure policy over plain data with `now` passed in; the owner (a PeerQueue) serialises access.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _PathRecord:
    num_consecutive_failures: int = 0
    cooldown_until: float = 0.0
    last_error: str = ""


class PathHealth:
    """Owns the failure record of each path id; not thread-safe (its owner holds a lock)."""

    def __init__(self, failure_threshold: int, cooldown_s: float) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self._records: dict[str, _PathRecord] = {}

    def record_failure(self, path: str, now: float, error: str) -> bool:
        """Count one failure; True when this failure put the path into cooldown."""
        record = self._records.setdefault(path, _PathRecord())
        record.num_consecutive_failures += 1
        record.last_error = error
        if record.num_consecutive_failures >= self.failure_threshold:
            record.cooldown_until = now + self.cooldown_s
            record.num_consecutive_failures = self.failure_threshold - 1
            return True
        return False

    def record_success(self, path: str) -> None:
        record = self._records.get(path)
        if record is not None:
            record.num_consecutive_failures = 0

    def is_usable(self, path: str, now: float) -> bool:
        record = self._records.get(path)
        return record is None or now >= record.cooldown_until

    def cooldown_until(self, path: str) -> float:
        record = self._records.get(path)
        return 0.0 if record is None else record.cooldown_until

    def last_error(self, path: str) -> str:
        record = self._records.get(path)
        return "" if record is None else record.last_error
