"""The pool study (`mooncaked sim pool-study`): how close a global KVCache pool comes to one ideal cache.

For every capacity (blocks per prefill node) and replay speed, side by side on one trace:
1. local: each node caches only for itself (`cache_aware` placement, no transfers, `replication: always`).
2. global: Algorithm 1 with transfers (`kvcache_centric`) under the configured `scheduler.replication`.
3. ideal: one cache of the whole pool's size (num_prefill x blocks per node) under the same eviction policy,
   requests in trace order (the cache study's hit rate): no duplicate blocks and one recency order.
The defaults are the paper's section 7.3.2 cluster (10 prefill nodes, outputs capped at one token, decode hosts
outside the pool, admission `none`) with `replication: by_reuse`, `tie_break: coldest_store` and `length_aware`
eviction; a config file or --set changes any of them (the paper's pool: `--set scheduler.replication=always
--set scheduler.tie_break=first --set cluster.eviction=lru`). Local placement uses the configured tie-break too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mooncaked.sim.cache_study import hit_rate
from mooncaked.sim.config import SimConfig, with_overrides
from mooncaked.sim.engine import Simulator
from mooncaked.sim.results import summarize
from mooncaked.sim.trace import load_trace

Progress = Callable[[int, int], None] | None

ROW_KEYS = ("blocks_per_node", "speed", "local_hit", "global_hit", "ideal_hit", "local_compute_s",
            "global_compute_s", "duplicate_blocks", "sole_copy_evictions")


def study_defaults(config: SimConfig) -> SimConfig:
    """The study's cluster and policy, under which a config file and --set are applied."""
    # one decode instance that never limits the prefills: RESERVE holds every placed request's pages and batch slot
    # from placement on, which at 2x would hold requests back before their prefill and make this a decode study
    config = with_overrides(config, "cluster", num_prefill=10, num_decode=1, decode_hosts_in_pool=False,
                            eviction="length_aware", max_batch_size=1_000_000)
    config = with_overrides(config, "gpu", hbm_bytes=1e15)
    config = with_overrides(config, "run", output_length_cap=1)
    return with_overrides(config, "scheduler", admission="none", replication="by_reuse", tie_break="coldest_store")


def run_pool_study(trace: str, base: SimConfig, blocks_per_node: Sequence[int], speeds: Sequence[float],
                   progress: Progress = None) -> dict[str, list[dict[str, Any]]]:
    """{"rows": [one dict of ROW_KEYS per (blocks per node, speed)]}, capacities outer, speeds inner."""
    rows: list[dict[str, Any]] = []
    requests_by_speed = {speed: load_trace(trace, speed, base.run.max_requests) for speed in speeds}
    num_runs, num_done = 2 * len(blocks_per_node) * len(speeds), 0
    for num_blocks in blocks_per_node:
        sized = with_overrides(base, "cluster", dram_blocks_per_host=num_blocks)
        pool_blocks = num_blocks * sized.cluster.num_prefill
        ideal = hit_rate(requests_by_speed[speeds[0]], sized.cluster.eviction, pool_blocks)
        for speed in speeds:
            config = with_overrides(sized, "run", speed=speed)
            local = with_overrides(config, "scheduler", scheduler="cache_aware", replication="always")
            pooled = with_overrides(config, "scheduler", scheduler="kvcache_centric")
            local_summary = summarize(Simulator(local, requests_by_speed[speed]).run())
            global_summary = summarize(Simulator(pooled, requests_by_speed[speed]).run())
            num_done += 2
            if progress is not None:
                progress(num_done, num_runs)
            rows.append(_row(num_blocks, speed, local_summary, global_summary, ideal))
    return {"rows": rows}


def _row(num_blocks: int, speed: float, local: dict[str, Any], pooled: dict[str, Any],
         ideal: float) -> dict[str, Any]:
    return {
        "blocks_per_node": num_blocks,
        "speed": speed,
        "local_hit": local["prefix_hit_rate"],
        "global_hit": pooled["prefix_hit_rate"],
        "ideal_hit": ideal,
        "local_compute_s": local["prefill_compute_mean_s"],
        "global_compute_s": pooled["prefill_compute_mean_s"],
        "duplicate_blocks": pooled["duplicate_blocks_mean"],
        "sole_copy_evictions": pooled["sole_copy_evictions"],
    }


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
    header = ("| blocks/node | speed | local hit | global hit | ideal hit | global/ideal | local compute (s) "
              "| global compute (s) | duplicate blocks | sole-copy evictions |")
    lines = [header, "|" + " --- |" * 10]
    for row in rows:
        ratio = row["global_hit"] / row["ideal_hit"] if row["ideal_hit"] else float("nan")
        lines.append(
            f"| {row['blocks_per_node']} | {row['speed']:g}x | {row['local_hit']:.4f} | {row['global_hit']:.4f} "
            f"| {row['ideal_hit']:.4f} | {ratio:.3f} | {row['local_compute_s']:.3f} | {row['global_compute_s']:.3f} "
            f"| {row['duplicate_blocks']:.0f} | {row['sole_copy_evictions']} |")
    return "\n".join(lines)
