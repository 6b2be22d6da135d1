"""The tier study (`mooncaked sim tiers`): where each prompt block comes from, with and without the device tier.

One trace, the same cluster and policy, run twice: without a device prefix cache, then with one on every single
prefill instance and every decode instance (`cluster.device_prefix_blocks`, by default the KV pages the cost model
leaves a node: the engine's pages, which the device tier shares with running requests). Per run: the share of
prompt blocks read from the prefilling instance's device tier (a decode instance's for an inline prefill), its
host's store, another host's store (fetched), and computed; TTFT and the
mean prefill compute. The device tier runs the engine's own policy (kv/device_cache.py via sim/device_tier.py)
and Algorithm 1 counts it in an instance's local prefix, as the conductor does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mooncaked.sim.config import SimConfig, with_overrides
from mooncaked.sim.costs import build_cost_model
from mooncaked.sim.engine import Simulator
from mooncaked.sim.results import summarize
from mooncaked.sim.trace import TraceRequest

Progress = Callable[[int, int], None] | None

ROW_KEYS = ("device_tier", "device_blocks", "device_hit_rate", "local_store_hit_rate", "remote_store_hit_rate",
            "computed_rate", "ttft_mean_s", "ttft_p90_s", "prefill_compute_mean_s", "slo_attainment")


def default_device_blocks(config: SimConfig) -> int:
    """The KV pages (blocks) one node holds under the cost model: what its device tier may use."""
    return max(1, build_cost_model(config).max_decode_context_tokens // config.scheduler.block_size)


def run_tier_study(requests: Sequence[TraceRequest], base: SimConfig, device_blocks: int = 0,
                   progress: Progress = None) -> dict[str, Any]:
    """{"rows": [the run without a device tier, the run with one]} of ROW_KEYS; device_blocks 0: the default."""
    num_device = device_blocks or default_device_blocks(base)
    rows = []
    for step, blocks in enumerate((0, num_device)):
        config = with_overrides(base, "cluster", device_prefix_blocks=blocks)
        summary = summarize(Simulator(config, list(requests)).run())
        if progress is not None:
            progress(step + 1, 2)
        rows.append(_row(blocks, summary))
    return {"rows": rows}


def _row(device_blocks: int, summary: dict[str, Any]) -> dict[str, Any]:
    hits = summary["device_hit_rate"] + summary["local_store_hit_rate"] + summary["remote_store_hit_rate"]
    return {"device_tier": device_blocks > 0, "device_blocks": device_blocks,
            **{key: summary[key] for key in ROW_KEYS[2:5]}, "computed_rate": 1.0 - hits,
            **{key: summary[key] for key in ROW_KEYS[6:]}}


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
    header = ("| device tier | device blocks/node | device hit | local store hit | remote store hit | computed "
              "| TTFT mean (s) | TTFT p90 (s) | prefill compute mean (s) | SLO attainment |")
    lines = [header, "|" + " --- |" * 10]
    for row in rows:
        lines.append(
            f"| {'on' if row['device_tier'] else 'off'} | {row['device_blocks']} | {row['device_hit_rate']:.4f} "
            f"| {row['local_store_hit_rate']:.4f} | {row['remote_store_hit_rate']:.4f} | {row['computed_rate']:.4f} "
            f"| {row['ttft_mean_s']:.3f} | {row['ttft_p90_s']:.3f} | {row['prefill_compute_mean_s']:.3f} "
            f"| {row['slo_attainment']:.4f} |")
    return "\n".join(lines)
