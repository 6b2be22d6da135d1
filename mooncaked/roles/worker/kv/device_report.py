"""What a LOAD reply says of the instance's device prefix cache: the block keys it gained and lost since the
caller's last report (kv/device_journal.py), or all of them when the caller missed too much. The conductor keeps
them in its device index, so placement counts this tier in a request's local prefix (sched/algorithm.py)."""

from __future__ import annotations

from typing import Any

from mooncaked.kv.device_journal import MAX_REPORTED_KEYS
from mooncaked.roles.worker.worker import Worker


def device_cache_report(worker: Worker, since_seq: int) -> dict[str, Any]:
    """LoadReply's device_cache_* fields for a caller that applied report `since_seq` ({} without a cache)."""
    pages, journal = worker.pages, worker.device_journal
    if pages is None or pages.cache is None or journal is None:
        return {}
    journal.record(*pages.cache.drain_changes())
    changes = journal.since(since_seq)
    if changes is None:
        return {"device_cache_seq": journal.seq, "device_keys_gained": pages.cache.keys()[-MAX_REPORTED_KEYS:],
                "is_device_cache_dump": True}
    gained, lost = changes
    return {"device_cache_seq": journal.seq, "device_keys_gained": gained, "device_keys_lost": lost}
