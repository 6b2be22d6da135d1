"""Where one prefill instance's reused prefix comes from: Algorithm 1's line 5, and the fast path or recompute when
that line's link is measured slow.

1. The paper's plan (line 5): the store holding the longest prefix (the first of equals) is fetched from when its
   prefix is more than `threshold` times the instance's local one, paying T_transfer for the missing blocks at
   the rate this instance measured from that store (`fetch_bandwidth`; never measured: the configured rate);
   else the local prefix, nothing fetched.
2. A slow link: the paper's store's measured rate is below the configured one. Line 5 trusts that fetching the
   longest prefix beats recomputing it, a premise of the configured (fast) network that a measured slow link
   breaks. Then the instance also weighs every other store whose prefix passes the same threshold rule (each at
   its own measured rate, or the configured one), longest first, and the local prefix alone (recompute the
   missing blocks). `mooncaked.sched.algorithm` takes the plan with the smallest predicted TTFT, the first of
   equals: the paper's plan wins every tie, so with no slow link every placement is the paper's. A measured rate
   is a lower bound of the link's (a fetch's fixed costs count in its seconds), so once an instance has measured
   a store its placements fetching from there are in practice by smallest predicted TTFT; before, the paper's.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from mooncaked.sched.predictors import TransferTimePredictor


@dataclass(frozen=True)
class PrefixPlan:
    """Reuse `num_prefix_blocks` leading blocks, fetching those past the local prefix from `source` (None:
    local only) in a predicted `transfer_s`."""

    num_prefix_blocks: int
    source: str | None
    transfer_s: float


def prefix_plans(local_len: int, prefix_lengths: Mapping[str, int], fetch_bandwidth: Mapping[str, float],
                 threshold: float, transfer: TransferTimePredictor) -> list[PrefixPlan]:
    """The plans to weigh for one instance: the paper's first; past it, when its link is measured slow, the
    other stores passing the threshold (longest first) and the local prefix alone. `prefix_lengths`: every
    store's prefix of the request (blocks, in the index's order); `fetch_bandwidth`: the instance's measured
    bytes per second per source store."""
    best_store, best_len = best_prefix(prefix_lengths)
    if best_store is None or not best_len > threshold * local_len:  # line 5, written without dividing by zero
        return [PrefixPlan(local_len, None, 0.0)]
    plans = [_fetch_plan(best_store, best_len, local_len, fetch_bandwidth, transfer)]
    if not is_slow(fetch_bandwidth.get(best_store, 0.0), transfer):
        return plans
    others = sorted(((length, store) for store, length in prefix_lengths.items()
                     if store != best_store and length > threshold * local_len), key=lambda pair: -pair[0])
    plans.extend(_fetch_plan(store, length, local_len, fetch_bandwidth, transfer) for length, store in others)
    plans.append(PrefixPlan(local_len, None, 0.0))
    return plans


def is_slow(measured_bandwidth: float, transfer: TransferTimePredictor) -> bool:
    """A link measured (> 0) below the configured rate."""
    return 0.0 < measured_bandwidth < transfer.bandwidth


def best_prefix(prefix_lengths: Mapping[str, int]) -> tuple[str | None, int]:
    """The store with the longest prefix (the first of equals) and its length; (None, 0) when none holds one."""
    best_store: str | None = None
    best_len = 0
    for store, length in prefix_lengths.items():
        if length > best_len:
            best_store, best_len = store, length
    return best_store, best_len


def _fetch_plan(store: str, length: int, local_len: int, fetch_bandwidth: Mapping[str, float],
                transfer: TransferTimePredictor) -> PrefixPlan:
    return PrefixPlan(length, store, transfer.predict(length - local_len, fetch_bandwidth.get(store, 0.0)))
