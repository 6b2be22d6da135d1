"""`mooncaked sim`: trace replay on virtual time, the cache study, and the documented experiments.

    mooncaked sim [run] --trace FILE [--config sim.yaml] [--json FILE] [--plots DIR] [--speed X]
                  [--scheduler NAME] [--admission NAME] [--model-config PATH] [--set section.key=value ...]
    mooncaked sim cache --trace FILE [--capacities 1000,10000,...,inf] [--policies lru,lfu,length_aware] [--json FILE]
    mooncaked sim experiments --trace FILE [--config sim.yaml] [--json FILE] [--plots DIR]
    mooncaked sim prediction-study --trace FILE [--errors 0,0.1,0.3,0.5] [--config sim.yaml] [--json FILE]
    mooncaked sim pool-study --trace FILE [--blocks-per-node 1000,2000,5859] [--speeds 1,2] [--json FILE]
                  [--config sim.yaml] [--set section.key=value ...]
    mooncaked sim cpp-study --trace FILE [--groups 4x2,2x4] [--buckets 2048,8192,...] [--config sim.yaml]
                  [--set section.key=value ...] [--json FILE]
    mooncaked sim tiers --trace FILE [--device-blocks N] [--config sim.yaml] [--json FILE]
    mooncaked sim pd-study [--phases 4] [--noise 0.7,1.5] [--seed 0] [--json FILE]

The main CLI calls `add_arguments(parser)` on its `sim` subparser and `run(args)` for the exit code. The first
positional word picks the mode (`run` when omitted). Progress goes to stderr, tables to stdout. In pool-study
mode the config file and --set apply on top of the study's own defaults (`mooncaked.sim.pool_study`).
`--model-config` is read by the main CLI (the simulator cannot load a model's config itself: model/sim_shape.py),
which puts the model's settings in front of `--set`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from mooncaked.kv.eviction import POLICY_NAMES
from mooncaked.sched.types import ADMISSION_POLICIES, SCHEDULERS
from mooncaked.sim.cache_study import DEFAULT_CAPACITIES, format_table, run_cache_study
from mooncaked.sim.config import SimConfig, SimConfigError, load_sim_config, with_overrides
from mooncaked.sim.engine import Simulator
from mooncaked.sim.results import format_summary, summarize, to_json
from mooncaked.sim.trace import TraceError, load_trace

MODES = ("run", "cache", "experiments", "prediction-study", "pool-study", "cpp-study", "pd-study", "tiers")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("mode", nargs="?", default="run", choices=MODES, help="what to do (default: run)")
    parser.add_argument("--trace", help="Mooncake JSONL trace (every mode but pd-study)")
    parser.add_argument("--config", help="sim YAML (see sim.example.yaml); built-in defaults when omitted")
    parser.add_argument("--json", help="write the JSON result here")
    parser.add_argument("--plots", help="directory for PNG plots")
    parser.add_argument("--speed", type=float, help="replay speed-up (2.0 = twice as fast)")
    parser.add_argument("--scheduler", choices=SCHEDULERS, help="prefill scheduler")
    parser.add_argument("--admission", choices=ADMISSION_POLICIES, help="admission policy")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="config override")
    parser.add_argument("--model-config", metavar="PATH", help="a model's Hugging Face config.json (or its directory):"
                        " its KV bytes per token, active parameters and attention width replace the model section's "
                        "(applied before --set)")
    parser.add_argument("--model-dtype-bytes", type=int, default=2, help="with --model-config: bytes per weight and "
                        "KV value (2: bf16)")
    parser.add_argument("--capacities", default="1000,10000,30000,50000,100000,inf", help="cache mode: blocks")
    parser.add_argument("--policies", default=",".join(POLICY_NAMES), help="cache mode: eviction policies")
    parser.add_argument("--errors", default="0,0.1,0.3,0.5",
                        help="prediction-study mode: sigmas of the log-normal prediction error")
    parser.add_argument("--blocks-per-node", default="1000,2000,5859", help="pool-study: DRAM blocks per node")
    parser.add_argument("--speeds", default="1,2", help="pool-study: replay speeds")
    parser.add_argument("--groups", default="4x2", help="cpp-study: prefill groups x stages per group, e.g. 4x2,2x4")
    parser.add_argument("--buckets", default="2048,8192,16384,32768,65536",
                        help="cpp-study: upper edges of the prompt-length buckets (tokens)")
    parser.add_argument("--phases", type=int, default=4, help="pd-study: alternating phases (prompt-, output-heavy)")
    parser.add_argument("--noise", type=_noise, default=(0.7, 1.5),
                        help="pd-study: every load sample times a factor drawn uniformly in LOW,HIGH")
    parser.add_argument("--seed", type=int, default=0, help="pd-study: the noise's seed")
    parser.add_argument("--device-blocks", type=int, default=0,
                        help="tiers: device prefix cache blocks per instance (0: the node's KV pages)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    if args.mode == "pd-study":
        return _run_pd_study(args)
    if not args.trace:
        print(f"mooncaked sim {args.mode}: --trace is required", file=sys.stderr)
        return 2
    try:
        config = _config_from_args(args)
        requests = load_trace(args.trace, config.run.speed, config.run.max_requests)
    except (SimConfigError, TraceError, OSError, ValueError) as exc:
        print(f"mooncaked sim: {exc}", file=sys.stderr)
        return 2
    progress = None if args.no_progress else _progress_bar(args.mode)
    if args.mode == "cache":
        return _run_cache(args, requests, progress)
    if args.mode == "prediction-study":
        return _run_prediction_study(args, config)
    if args.mode == "pool-study":
        return _run_pool_study(args, config, progress)
    if args.mode == "cpp-study":
        return _run_cpp_study(args, config, progress)
    if args.mode == "tiers":
        return _run_tiers(args, config, requests, progress)
    if args.mode == "experiments":
        from mooncaked.sim.experiments import run_experiments

        result = run_experiments(args.trace, config, Path(args.plots) if args.plots else None, progress)
        _write_json(args.json, result)
        return 0
    simulator = Simulator(config, requests)
    sim_result = simulator.run(progress)
    sim_result.config = _config_dict(config)
    print(format_summary(summarize(sim_result)))
    _write_json(args.json, to_json(sim_result))
    if args.plots:
        from mooncaked.sim.plots import plot_latency_cdfs, plot_loads

        directory = Path(args.plots)
        directory.mkdir(parents=True, exist_ok=True)
        label = f"{config.scheduler.scheduler}/{config.scheduler.admission}"
        slo = config.scheduler
        plot_latency_cdfs({label: sim_result}, directory / "latency_cdf.png", slo.ttft_slo_s, slo.tbt_slo_s)
        plot_loads({label: sim_result}, directory / "load.png")
    return 0


def _run_pd_study(args: argparse.Namespace) -> int:
    from mooncaked.sim.pd_study import PdStudyConfig, format_result, run_pd_study

    try:
        config = PdStudyConfig(seed=args.seed, num_phases=args.phases, noise_low=args.noise[0],
                               noise_high=args.noise[1])
    except ValueError as exc:
        print(f"mooncaked sim pd-study: {exc}", file=sys.stderr)
        return 2
    result = run_pd_study(config)
    print(format_result(result))
    _write_json(args.json, result)
    return 0


def _noise(text: str) -> tuple[float, float]:
    low, sep, high = text.partition(",")
    try:
        return float(low), float(high if sep else low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH factors like 0.7,1.5, got {text!r}") from None


def _run_prediction_study(args: argparse.Namespace, config: SimConfig) -> int:
    from mooncaked.sim.prediction_study import format_rows, run_prediction_study

    try:
        errors = [float(e) for e in args.errors.split(",") if e.strip()]
    except ValueError:
        errors = []
    if not errors or any(not 0 <= e <= 5 for e in errors):
        print(f"mooncaked sim prediction-study: --errors must be numbers in [0, 5], got {args.errors!r}",
              file=sys.stderr)
        return 2
    result = run_prediction_study(args.trace, config, errors)
    print(format_rows(result["rows"]))
    _write_json(args.json, result)
    return 0


def _run_cache(args: argparse.Namespace, requests: list[Any], progress: Any) -> int:
    try:
        capacities = [None if c.strip() in ("inf", "none") else int(c) for c in args.capacities.split(",")]
    except ValueError:
        print(f"mooncaked sim cache: --capacities must be integers or inf, got {args.capacities!r}", file=sys.stderr)
        return 2
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICY_NAMES]
    if unknown or any(c is not None and c < 0 for c in capacities):
        print(f"mooncaked sim cache: policies must be in {POLICY_NAMES} and capacities >= 0", file=sys.stderr)
        return 2
    result = run_cache_study(requests, policies, capacities or list(DEFAULT_CAPACITIES), progress)
    print(format_table(result))
    _write_json(args.json, result)
    return 0


def _run_pool_study(args: argparse.Namespace, config: SimConfig, progress: Any) -> int:
    from mooncaked.sim.pool_study import format_rows, run_pool_study

    try:
        blocks = [int(b) for b in args.blocks_per_node.split(",")]
        speeds = [float(s) for s in args.speeds.split(",")]
    except ValueError:
        print(f"mooncaked sim pool-study: --blocks-per-node takes integers and --speeds numbers, comma-separated; "
              f"got {args.blocks_per_node!r} and {args.speeds!r}", file=sys.stderr)
        return 2
    if not blocks or not speeds or min(blocks) < 1 or not min(speeds) > 0:
        print("mooncaked sim pool-study: --blocks-per-node must be >= 1 and --speeds > 0", file=sys.stderr)
        return 2
    result = run_pool_study(args.trace, config, blocks, speeds, progress)
    print(format_rows(result["rows"]))
    _write_json(args.json, result)
    return 0


def _run_cpp_study(args: argparse.Namespace, config: SimConfig, progress: Any) -> int:
    from mooncaked.sim.cpp_study import format_table, parse_buckets, parse_groups, run_cpp_study, study_variants

    try:
        groups, buckets = parse_groups(args.groups), parse_buckets(args.buckets)
        study_variants(config, groups)  # every variant's config is valid before the first run
    except SimConfigError as exc:
        print(f"mooncaked sim cpp-study: {exc}", file=sys.stderr)
        return 2
    result = run_cpp_study(args.trace, config, groups, buckets, progress)
    print("== TTFT by prompt length ==")
    print(format_table(result))
    print("== TTFT by new (uncached) tokens ==")
    print(format_table(result, "rows_by_new_tokens"))
    _write_json(args.json, result)
    return 0


def _run_tiers(args: argparse.Namespace, config: SimConfig, requests: list[Any], progress: Any) -> int:
    from mooncaked.sim.tier_study import format_rows, run_tier_study

    if args.device_blocks < 0:
        print("mooncaked sim tiers: --device-blocks must be >= 0", file=sys.stderr)
        return 2
    result = run_tier_study(requests, config, args.device_blocks, progress)
    print(format_rows(result["rows"]))
    _write_json(args.json, result)
    return 0


def _config_from_args(args: argparse.Namespace) -> SimConfig:
    base = SimConfig()
    if args.mode == "pool-study":
        from mooncaked.sim.pool_study import study_defaults

        base = study_defaults(base)
    config = load_sim_config(args.config, base) if args.config else base
    if args.speed is not None:
        config = with_overrides(config, "run", speed=args.speed)
    if args.scheduler:
        config = with_overrides(config, "scheduler", scheduler=args.scheduler)
    if args.admission:
        config = with_overrides(config, "scheduler", admission=args.admission)
    for item in args.set:
        key, sep, raw = item.partition("=")
        section, dot, name = key.partition(".")
        if not sep or not dot:
            raise SimConfigError(f"--set {item!r}: expected SECTION.KEY=VALUE, e.g. cluster.num_prefill=8")
        if section not in ("cluster", "model", "gpu", "scheduler", "run"):
            raise SimConfigError(f"--set {item!r}: unknown section {section!r}")
        config = with_overrides(config, section, **{name: yaml.safe_load(raw)})
    return config


def _config_dict(config: SimConfig) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(config)


def _write_json(path: str | None, data: Any) -> None:
    if path:
        Path(path).write_text(json.dumps(data, indent=1, default=str) + "\n")


def _progress_bar(label: str) -> Any:
    def show(done: int, total: int) -> None:
        width = 30
        filled = width * done // max(total, 1)
        end = "\n" if done >= total else ""
        print(f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}", end=end, file=sys.stderr, flush=True)

    return show
