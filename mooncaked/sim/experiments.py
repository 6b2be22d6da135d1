"""The experiments of docs/simulation.md, run side by side on one trace (`mooncaked sim experiments`).

1. cache: Table 1 layout, LRU/LFU/length-aware x 1k..100k blocks and unbounded, one global cache.
2. prefill_scheduling (Figure 5): random, load_balancing, cache_aware, kvcache_centric on the base cluster
   (admission `none`, so every request is served and TTFTs compare like for like).
3. overload (section 7.6): 8 prefill + 8 decode at 2x speed under baseline, early_rejection and
   early_rejection_predicted.
4. global_vs_local (section 7.3.2): 10 prefill nodes, outputs capped at 1 token; local = cache_aware with no
   transfers, global = kvcache_centric with transfers (migration).
Each returns summaries (and, with a plot directory, PNGs); the caller writes the JSON.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from mooncaked.sim.cache_study import DEFAULT_CAPACITIES, format_table, run_cache_study
from mooncaked.sim.config import SimConfig, with_overrides
from mooncaked.sim.engine import Simulator
from mooncaked.sim.results import SimResult, summarize
from mooncaked.sim.trace import load_trace

Progress = Callable[[int, int], None] | None
_COLUMNS = ("num_rejected", "num_wasted_prefills", "num_slo_met", "slo_attainment", "ttft_mean_s", "ttft_p90_s", "tbt_p90_s", "prefix_hit_rate",
            "prefill_compute_mean_s", "prefill_load_std", "decode_load_std", "load_correlation", "sim_seconds")


def run_experiments(trace: str, base: SimConfig, plots: Path | None, progress: Progress) -> dict[str, Any]:
    if plots is not None:
        plots.mkdir(parents=True, exist_ok=True)
    requests = load_trace(trace, 1.0, base.run.max_requests)
    cache = run_cache_study(requests, ["lru", "lfu", "length_aware"], list(DEFAULT_CAPACITIES))
    print("== cache hit rate (one global cache) ==")
    print(format_table(cache))
    return {
        "cache": cache,
        "prefill_scheduling": prefill_scheduling(trace, base, plots, progress),
        "overload": overload(trace, base, plots, progress),
        "overload_decode_heavy": overload(trace, base, plots, progress, output_length_scale=16.0),
        "global_vs_local": global_vs_local(trace, base, progress),
    }


def prefill_scheduling(trace: str, base: SimConfig, plots: Path | None, progress: Progress) -> dict[str, Any]:
    config = with_overrides(base, "scheduler", admission="none")
    variants = {name: with_overrides(config, "scheduler", scheduler=name)
                for name in ("random", "load_balancing", "cache_aware", "kvcache_centric")}
    runs = _run_all(trace, variants, progress)
    _print_table("prefill scheduling (Figure 5)", runs)
    if plots is not None:
        from mooncaked.sim.plots import plot_latency_cdfs

        slo = config.scheduler
        plot_latency_cdfs(runs, plots / "prefill_scheduling_cdf.png", slo.ttft_slo_s, slo.tbt_slo_s)
    return {name: summarize(result) for name, result in runs.items()}


def overload(
    trace: str, base: SimConfig, plots: Path | None, progress: Progress, output_length_scale: float = 1.0
) -> dict[str, Any]:
    """Baseline runs first; its mean measured decode duration becomes t_d of the prediction-based policy
    (an operator calibrates t_d the same way, from the served requests)."""
    config = with_overrides(base, "cluster", num_prefill=8, num_decode=8)
    config = with_overrides(config, "run", speed=2.0, output_length_scale=output_length_scale)
    runs = _run_all(trace, {"baseline": with_overrides(config, "scheduler", admission="baseline")}, progress)
    decode_time_s = _mean_decode_time(runs["baseline"])
    variants = {
        "early_rejection": with_overrides(config, "scheduler", admission="early_rejection"),
        "early_rejection_predicted": with_overrides(
            config, "scheduler", admission="early_rejection_predicted", decode_time_s=decode_time_s
        ),
    }
    runs.update(_run_all(trace, variants, progress))
    suffix = "" if output_length_scale == 1.0 else f", outputs x{output_length_scale:g}"
    _print_table(f"overload: 8P+8D at 2x{suffix} (Table 3), t_d = {decode_time_s:.1f} s", runs)
    if plots is not None:
        from mooncaked.sim.plots import plot_loads

        name = "overload_load.png" if output_length_scale == 1.0 else f"overload_load_x{output_length_scale:g}.png"
        plot_loads(runs, plots / name)
    summaries: dict[str, Any] = {name: summarize(result) for name, result in runs.items()}
    summaries["decode_time_s"] = decode_time_s
    return summaries


def _mean_decode_time(result: SimResult) -> float:
    durations = [r.finished_s - r.arrival_s - r.ttft_s for r in result.records
                 if not r.rejection_reason and r.output_length > 1]
    return max(sum(durations) / len(durations), 0.1) if durations else 5.0


def global_vs_local(trace: str, base: SimConfig, progress: Progress) -> dict[str, Any]:
    config = with_overrides(base, "cluster", num_prefill=10, num_decode=1, decode_hosts_in_pool=False)
    config = with_overrides(config, "run", output_length_cap=1)
    config = with_overrides(config, "scheduler", admission="none")
    variants = {
        "local": with_overrides(config, "scheduler", scheduler="cache_aware"),
        "global": with_overrides(config, "scheduler", scheduler="kvcache_centric"),
    }
    runs = _run_all(trace, variants, progress)
    _print_table("global vs local cache (section 7.3.2)", runs)
    return {name: summarize(result) for name, result in runs.items()}


def _run_all(trace: str, variants: dict[str, SimConfig], progress: Progress) -> dict[str, SimResult]:
    runs: dict[str, SimResult] = {}
    for name, config in variants.items():
        requests = load_trace(trace, config.run.speed, config.run.max_requests)
        runs[name] = Simulator(config, requests).run(progress)
    return runs


def _print_table(title: str, runs: dict[str, SimResult]) -> None:
    print(f"== {title} ==")
    print(f"{'variant':<26}" + "".join(f"{c[:14]:>15}" for c in _COLUMNS))
    for name, result in runs.items():
        summary = summarize(result)
        cells = "".join(f"{_cell(summary[c]):>15}" for c in _COLUMNS)
        print(f"{name:<26}{cells}")


def _cell(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
