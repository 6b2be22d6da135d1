"""Cache study (the paper's Table 1): hit rate of one global block cache per eviction policy and capacity.

1. The trace's hash ids are replayed in trace order, each request as a prefix lookup followed by an insert of
   its remaining blocks (`mooncaked.kv.eviction.BlockCache.access`, the store's own eviction code).
2. Hit rate = blocks found in cache / blocks looked up. The unbounded cache reaches the trace's ceiling: the
   share of hash ids already seen in an earlier request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mooncaked.kv.block_cache import BlockCache
from mooncaked.kv.eviction import make_eviction_policy
from mooncaked.sim.trace import TraceRequest

DEFAULT_CAPACITIES: tuple[int | None, ...] = (1000, 10000, 30000, 50000, 100000, None)


def trace_ceiling(requests: Sequence[TraceRequest]) -> float:
    """Share of hash ids already seen in an earlier request (the unbounded-cache hit rate)."""
    seen: set[int] = set()
    num_seen = 0
    num_total = 0
    for request in requests:
        num_seen += sum(1 for h in request.hash_ids if h in seen)
        num_total += len(request.hash_ids)
        seen.update(request.hash_ids)
    return num_seen / num_total if num_total else 0.0


def hit_rate(requests: Sequence[TraceRequest], policy: str, capacity: int | None) -> float:
    cache = BlockCache(make_eviction_policy(policy), capacity)
    for request in requests:
        cache.access(request.hash_ids, request.arrival_s)
    return cache.hit_rate


def run_cache_study(
    requests: Sequence[TraceRequest],
    policies: Sequence[str],
    capacities: Sequence[int | None],
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, object]:
    """{"ceiling": float, "hit_rate": {policy: {capacity or "inf": float}}}."""
    table: dict[str, dict[str, float]] = {}
    num_done = 0
    for policy in policies:
        row: dict[str, float] = {}
        for capacity in capacities:
            row["inf" if capacity is None else str(capacity)] = hit_rate(requests, policy, capacity)
            num_done += 1
            if progress is not None:
                progress(num_done, len(policies) * len(capacities))
        table[policy] = row
    return {"ceiling": trace_ceiling(requests), "hit_rate": table}


def format_table(result: dict[str, object]) -> str:
    table = result["hit_rate"]
    assert isinstance(table, dict)
    capacities = list(next(iter(table.values())).keys()) if table else []
    header = f"{'policy':<14}" + "".join(f"{c:>9}" for c in capacities)
    lines = [header]
    for policy, row in table.items():
        lines.append(f"{policy:<14}" + "".join(f"{row[c]:>9.4f}" for c in capacities))
    lines.append(f"ceiling (share of hash ids seen before): {result['ceiling']:.4f}")
    return "\n".join(lines)
