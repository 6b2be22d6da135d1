"""Per-request records of a simulation run and their summary (JSON-ready, printable).

TBT follows the paper (section 7.1): the mean of the longest 10% of a request's token gaps.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    index: int
    arrival_s: float
    input_length: int
    output_length: int
    num_blocks: int
    prefill_instance: str = ""
    decode_instance: str = ""
    rejection_reason: str = ""
    ttft_s: float = math.nan
    tbt_s: float = math.nan
    slo_met: bool = False
    prefix_blocks: int = 0
    local_prefix_blocks: int = 0
    fetched_blocks: int = 0
    fetch_source: str = ""
    prefill_compute_s: float = 0.0
    predicted_ttft_s: float = math.nan
    finished_s: float = math.nan
    wasted_prefill: bool = False
    is_pipelined: bool = False  # prefilled by a prefill group
    is_inline: bool = False  # prefilled on its decode instance (prefill_instance names that instance)
    device_blocks: int = 0  # prefix blocks read from its prefill instance's device tier (inline: its decode's)


@dataclass
class LoadSample:
    time_s: float
    prefill_load: float  # busy fraction of the prefill pool over the last interval
    decode_load: float  # mean predicted step time / TBT SLO over decode instances (1.0 = at the SLO)
    num_decode_running: int
    num_duplicate_blocks: int = 0  # copies in the pool beyond the first of each block


@dataclass
class SimResult:
    records: list[RequestRecord]
    samples: list[LoadSample]
    sim_seconds: float = 0.0
    virtual_seconds: float = 0.0
    config: dict[str, Any] = field(default_factory=dict)
    num_evicted_blocks: int = 0  # over all stores
    num_sole_copy_evictions: int = 0  # evictions of a block no other store held


def tbt_of(gaps: Sequence[float]) -> float:
    """Mean of the longest 10% of the gaps (at least one); 0.0 without gaps."""
    if not gaps:
        return 0.0
    count = max(1, math.ceil(len(gaps) * 0.1))
    longest = sorted(gaps, reverse=True)[:count]
    return sum(longest) / count


def percentile(values: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile; nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = min(len(ordered) - 1, max(0, math.ceil(fraction * len(ordered)) - 1))
    return ordered[rank]


def summarize(result: SimResult) -> dict[str, Any]:
    records = result.records
    served = [r for r in records if not r.rejection_reason]
    ttfts = [r.ttft_s for r in served]
    tbts = [r.tbt_s for r in served if r.output_length > 1]
    num_blocks = sum(r.num_blocks for r in records if r.prefill_instance)
    reused = sum(r.prefix_blocks for r in records if r.prefill_instance)
    computed = [r.prefill_compute_s for r in records if r.prefill_instance]
    prefill_loads = [s.prefill_load for s in result.samples]
    decode_loads = [s.decode_load for s in result.samples]
    return {
        "num_requests": len(records),
        "num_served": len(served),
        "num_rejected": len(records) - len(served),
        "rejections": dict(sorted(Counter(r.rejection_reason for r in records if r.rejection_reason).items())),
        "num_wasted_prefills": sum(1 for r in records if r.wasted_prefill),
        "num_pipelined": sum(1 for r in served if r.is_pipelined),
        "num_inline": sum(1 for r in served if r.is_inline),
        "num_slo_met": sum(1 for r in records if r.slo_met),
        "slo_attainment": sum(1 for r in records if r.slo_met) / len(records) if records else math.nan,
        "ttft_mean_s": _mean(ttfts),
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p90_s": percentile(ttfts, 0.9),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "tbt_mean_s": _mean(tbts),
        "tbt_p90_s": percentile(tbts, 0.9),
        "prefix_hit_rate": reused / num_blocks if num_blocks else math.nan,
        **tier_hit_rates(records),
        "fetched_blocks": sum(r.fetched_blocks for r in records),
        "prefill_compute_mean_s": _mean(computed),
        "prefill_compute_total_s": sum(computed),
        "prefill_load_mean": _mean(prefill_loads),
        "prefill_load_std": _std(prefill_loads),
        "decode_load_mean": _mean(decode_loads),
        "decode_load_std": _std(decode_loads),
        "load_correlation": _correlation(prefill_loads, decode_loads),
        "duplicate_blocks_mean": _mean([float(s.num_duplicate_blocks) for s in result.samples]),
        "duplicate_blocks_max": max((s.num_duplicate_blocks for s in result.samples), default=0),
        "evicted_blocks": result.num_evicted_blocks,
        "sole_copy_evictions": result.num_sole_copy_evictions,
        "sim_seconds": result.sim_seconds,
        "virtual_seconds": result.virtual_seconds,
    }


def to_json(result: SimResult) -> dict[str, Any]:
    return {
        "summary": _finite(summarize(result)),
        "config": result.config,
        "samples": [asdict(s) for s in result.samples],
        "requests": [_finite(asdict(r)) for r in result.records],
    }


def tier_hit_rates(records: Sequence[RequestRecord]) -> dict[str, float]:
    """Prompt blocks served by each tier, as shares of the prefilled prompts' blocks: the prefill instance's device
    prefix cache, its host's store, another host's store (fetched); the rest was computed."""
    prefilled = [r for r in records if r.prefill_instance]
    num_blocks = sum(r.num_blocks for r in prefilled)
    device = local = remote = 0
    for r in prefilled:
        device += r.device_blocks
        fetched_end = min(r.local_prefix_blocks + r.fetched_blocks, r.prefix_blocks)
        num_remote = max(0, fetched_end - max(r.device_blocks, r.local_prefix_blocks)) if r.fetched_blocks else 0
        remote += num_remote
        local += max(0, r.prefix_blocks - r.device_blocks - num_remote)
    if not num_blocks:
        return {"device_hit_rate": math.nan, "local_store_hit_rate": math.nan, "remote_store_hit_rate": math.nan}
    return {"device_hit_rate": device / num_blocks, "local_store_hit_rate": local / num_blocks,
            "remote_store_hit_rate": remote / num_blocks}


def format_summary(summary: dict[str, Any]) -> str:
    lines = []
    for key, value in summary.items():
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        lines.append(f"{key:<24} {shown}")
    return "\n".join(lines)


def _finite(values: dict[str, Any]) -> dict[str, Any]:
    """NaN is not JSON: written as null."""
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in values.items()}


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _std(values: Sequence[float]) -> float:
    if len(values) < 2:
        return math.nan
    mean = _mean(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _correlation(xs: Sequence[float], ys: Sequence[float]) -> float:
    if len(xs) < 2 or len(xs) != len(ys):
        return math.nan
    mx, my = _mean(xs), _mean(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else math.nan
