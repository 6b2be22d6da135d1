"""TTFT by prompt length with and without prefill groups (`mooncaked sim cpp-study`).

1. Variants on one trace and one cluster, admission `none` (every request is served, so TTFTs compare like for
   like): `no_cpp`, every prefill node a single instance, and per `GxS` spec G groups of S stages built from the
   same prefill nodes (`cluster.num_prefill_groups`, `cluster.stages_per_group`), the rest single instances.
2. Requests are bucketed by prompt length (`rows`) and by new tokens, the prompt less the prefix its prefill
   reused (`rows_by_new_tokens`); `buckets` are the upper edges, the last bucket is open. Per bucket and
   variant: the number of requests, mean / p50 / p90 TTFT, how many exceed the TTFT SLO and the share prefilled
   by a group. `format_table` prints one of them as a markdown table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mooncaked.sim.config import SimConfig, SimConfigError, with_overrides
from mooncaked.sim.engine import Simulator
from mooncaked.sim.results import RequestRecord, SimResult, percentile, summarize
from mooncaked.sim.trace import load_trace

DEFAULT_BUCKETS = (2048, 8192, 16384, 32768, 65536)
DEFAULT_GROUPS = ((4, 2),)
NO_CPP = "no_cpp"

Progress = Callable[[int, int], None] | None


def parse_groups(text: str) -> list[tuple[int, int]]:
    """'4x2,2x4' -> [(4, 2), (2, 4)]: groups x stages per group."""
    specs = []
    for item in text.split(","):
        groups, sep, stages = item.strip().partition("x")
        try:
            spec = (int(groups), int(stages)) if sep and groups.isdecimal() and stages.isdecimal() else (0, 0)
        except ValueError:  # more digits than int() reads
            spec = (0, 0)
        if spec[0] < 1 or spec[1] < 2:
            raise SimConfigError(f"--groups: expected GROUPSxSTAGES items like 4x2 (groups >= 1, stages >= 2), "
                                 f"got {item.strip()!r}")
        specs.append(spec)
    return specs


def parse_buckets(text: str) -> list[int]:
    """'2048,8192' -> [2048, 8192]: increasing upper edges of the prompt-length buckets."""
    try:
        edges = [int(edge) for edge in text.split(",")]
    except ValueError:
        edges = []
    if not edges or edges[0] < 1 or any(b <= a for a, b in zip(edges, edges[1:])):
        raise SimConfigError(f"--buckets: expected increasing token counts >= 1, comma-separated, got {text!r}")
    return edges


def variant_name(num_groups: int, num_stages: int) -> str:
    return f"cpp_{num_groups}x{num_stages}"


def study_variants(base: SimConfig, groups: Sequence[tuple[int, int]]) -> dict[str, SimConfig]:
    """`no_cpp` and one variant per (groups, stages); SimConfigError when the groups need more prefill nodes."""
    config = with_overrides(base, "scheduler", admission="none")
    variants = {NO_CPP: with_overrides(config, "cluster", num_prefill_groups=0)}
    for num_groups, num_stages in groups:
        variants[variant_name(num_groups, num_stages)] = with_overrides(
            config, "cluster", num_prefill_groups=num_groups, stages_per_group=num_stages)
    return variants


def bucket_rows(records: Sequence[RequestRecord], buckets: Sequence[int], ttft_slo_s: float,
                length: Callable[[RequestRecord], int] = lambda r: r.input_length) -> list[dict[str, Any]]:
    """One row per bucket of `length` (the prompt's by default) over the served requests (empty buckets
    included, with nan TTFTs)."""
    rows = []
    for low, high in zip([0, *buckets], [*buckets, None]):
        served = [r for r in records if not r.rejection_reason and low < length(r)
                  and (high is None or length(r) <= high)]
        ttfts = [r.ttft_s for r in served]
        count = len(served)
        rows.append({
            "bucket": _label(low, high), "min_tokens": low + 1, "max_tokens": high, "num_requests": count,
            "ttft_mean_s": sum(ttfts) / count if count else float("nan"),
            "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p90_s": percentile(ttfts, 0.9),
            "num_over_slo": sum(1 for t in ttfts if t > ttft_slo_s),
            "pipelined_share": sum(1 for r in served if r.is_pipelined) / count if count else float("nan"),
        })
    return rows


def run_cpp_study(trace: str, base: SimConfig, groups: Sequence[tuple[int, int]],
                  buckets: Sequence[int], progress: Progress = None) -> dict[str, Any]:
    variants = study_variants(base, groups)
    result: dict[str, Any] = {"buckets": list(buckets), "variants": {}}
    for name, config in variants.items():
        run = _run(trace, config, progress)
        slo_s, block_size = config.scheduler.ttft_slo_s, config.scheduler.block_size
        result["variants"][name] = {
            "num_prefill_groups": config.cluster.num_prefill_groups,
            "stages_per_group": config.cluster.stages_per_group,
            "summary": summarize(run),
            "rows": bucket_rows(run.records, buckets, slo_s),
            "rows_by_new_tokens": bucket_rows(run.records, buckets, slo_s, lambda r: new_tokens(r, block_size)),
        }
    return result


def new_tokens(record: RequestRecord, block_size: int) -> int:
    """The tokens a request's prefill computed: its prompt less the reused prefix (the last token always)."""
    return record.input_length - min(record.prefix_blocks * block_size, record.input_length - 1)


def format_table(study: dict[str, Any], rows: str = "rows") -> str:
    """A markdown table of `rows` (or `rows_by_new_tokens`): per bucket the request count (per variant where
    they differ), then per variant the mean / p90 TTFT, the requests over the TTFT SLO and (CPP variants) the
    share prefilled by a group; a last row over all requests."""
    variants: dict[str, Any] = study["variants"]
    header = ["prompt tokens" if rows == "rows" else "new tokens", "requests"]
    for name in variants:
        header += [f"{name}: mean / p90 TTFT (s)", f"{name}: over SLO"]
        header += [] if name == NO_CPP else [f"{name}: on a group"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    first = next(iter(variants.values()))
    for i, row in enumerate(first[rows]):
        counts = [str(variant[rows][i]["num_requests"]) for variant in variants.values()]
        cells = [row["bucket"], counts[0] if len(set(counts)) == 1 else " / ".join(counts)]
        for name, variant in variants.items():
            cells += _cells(name, variant[rows][i])
        lines.append("| " + " | ".join(cells) + " |")
    totals = ["all", str(first["summary"]["num_served"])]
    for name, variant in variants.items():
        summary = variant["summary"]
        totals += _cells(name, {"ttft_mean_s": summary["ttft_mean_s"], "ttft_p90_s": summary["ttft_p90_s"],
                                "num_over_slo": sum(row["num_over_slo"] for row in variant[rows]),
                                "pipelined_share": summary["num_pipelined"] / max(summary["num_served"], 1)})
    lines.append("| " + " | ".join(totals) + " |")
    return "\n".join(lines)


def _cells(name: str, row: dict[str, Any]) -> list[str]:
    cells = [f"{_number(row['ttft_mean_s'])} / {_number(row['ttft_p90_s'])}", str(row["num_over_slo"])]
    return cells if name == NO_CPP else [*cells, _number(row["pipelined_share"])]


def _run(trace: str, config: SimConfig, progress: Progress) -> SimResult:
    requests = load_trace(trace, config.run.speed, config.run.max_requests)
    return Simulator(config, requests).run(progress)


def _label(low: int, high: int | None) -> str:
    if high is None:
        return f"> {low}"
    return f"<= {high}" if low == 0 else f"{low + 1}-{high}"


def _number(value: float) -> str:
    return "-" if value != value else f"{value:.2f}"
