"""A placed request's prefix on its prefill host: the remote fetch and the reuse found when the prefill starts.

1. `start_fetch`: the reused part held by another store is locked there and moved over both hosts' NICs, each
   busy until the fetch is done (bytes / bandwidth, after whatever they carried before).
2. `finish_fetch` (FETCH_DONE): the fetched blocks are committed to the prefill host's store where they find
   room (hot-spot replication) and locked there; the source unlocks them.
3. `reusable_blocks_at_start`: when the prefill starts, the planned prefix plus the blocks after it that
   earlier prefills on this host committed meanwhile (a store lookup at execution), locked for the job.
"""

from __future__ import annotations

from collections.abc import Hashable

from mooncaked.sched.predictors import TransferTimePredictor
from mooncaked.sched.types import Placement
from mooncaked.sim.cluster import HostStore, PrefillJob


def start_fetch(now: float, source: HostStore, destination: HostStore, placement: Placement,
                keys: tuple[int, ...], transfer: TransferTimePredictor) -> float:
    """Locks the fetched blocks at `source`; returns when the fetch is done."""
    source.cache.lock(keys[placement.num_local_prefix_blocks : placement.num_prefix_blocks])
    start = max(now, source.nic_free_at, destination.nic_free_at)
    done = start + transfer.predict(placement.num_fetch_blocks)
    source.nic_free_at = destination.nic_free_at = done
    return done


def finish_fetch(now: float, job: PrefillJob, destination: HostStore, source: HostStore) -> None:
    placement = job.placement
    fetched = job.keys[placement.num_local_prefix_blocks : placement.num_prefix_blocks]
    destination.put(job.keys[: placement.num_prefix_blocks], now)
    resident = [key for key in fetched if key in destination.cache]
    destination.cache.lock(resident)
    job.locked_keys.extend(resident)
    source.cache.unlock(fetched)
    job.is_fetch_pending = False


def reusable_blocks_at_start(store: HostStore, job: PrefillJob, num_device: int = 0) -> int:
    """The planned prefix, and the blocks after it that earlier prefills on this host committed meanwhile (a
    store lookup at execution). The planned local part is locked since placement; the fetched part is in the
    job's pages once its fetch is done, whether or not it found room in this store: the instance reads it from
    the source into the request's pages and only caches it where there is room (roles/worker/kv/plan.py,
    "reuse, but do not cache"), so a full store costs the replica, not the reuse. `num_device`: leading blocks
    read from the instance's device tier: a planned local part only that tier held counts as far as it still
    holds it (it may have evicted them since the placement)."""
    placement = job.placement
    if job.is_fetch_pending:
        return max(placement.num_prefix_blocks, num_device)
    cache, keys = store.cache, job.keys
    fetched = range(placement.num_local_prefix_blocks, placement.num_prefix_blocks) \
        if placement.fetch_from_store is not None else range(0)
    num_prefix = 0
    extra: list[Hashable] = []
    locked = set(job.locked_keys)
    while num_prefix < len(keys):
        key = keys[num_prefix]
        if num_prefix in fetched or num_prefix < num_device:
            pass
        elif key in cache:
            if key not in locked:
                extra.append(key)
        else:
            break
        num_prefix += 1
    cache.lock(extra)
    job.locked_keys.extend(extra)
    return num_prefix
