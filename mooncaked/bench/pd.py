"""`mooncaked bench pd`: disaggregated prefill/decode versus colocated serving on the same cores (paper section 4).

1. Two layouts of the same model on this host, each one compute thread per worker (runtime.num_threads=1):
   `disaggregated` = 1 prefill + 1 decode instance (prompts up to `--disagg-inline-max-tokens`, 0 by default,
   are prefilled on the decode instance, as the config's `inline_prefill_max_tokens` does); `colocated` =
   2 decode instances and no prefill instance, so every request is prefilled inline on a decode instance (the
   vLLM-like baseline). Both have a conductor and one store; `--admission` (none by default: every request
   is served, none answered 429) is the scheduler's admission policy in both.
2. One workload for both: short chats (`--chat-tokens`) with a long document (`--doc-tokens`) every
   `--doc-every`-th request, `--output-tokens` each (ignore_eos), Poisson arrivals at each rate of `--rates`
   over `--duration-s` (at most `--max-requests`); a run ends `--tail-s` after the last arrival at the latest.
3. Per layout: write the YAML, start `python -m mooncaked --role all` (wait for GET /health), send an unloaded
   probe (chat, document, chat; one at a time) as warm-up, then each rate through `bench serve`'s load
   generator; SIGTERM the tree. The TBT SLO for goodput is `--tbt-slo-ms`, or `--tbt-slo-factor` times the
   median inter-token latency of the first layout's unloaded probe (one decode step of a batch of one, plus
   the HTTP hop), the same SLO for both layouts.
4. Print a side-by-side table per rate (TBT p90, TTFT p90, goodput, rejected, failed) and write the JSON with
   the disaggregated / colocated ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from mooncaked.bench.cluster import ClusterProcess, instance, write_config
from mooncaked.bench.report import report
from mooncaked.bench.serve import ServeBenchConfig, run_benchmark
from mooncaked.bench.trace import BenchRequest, TokenBlocks, poisson_arrivals

LAYOUTS = ("disaggregated", "colocated")
NO_SLO_MS = 3_600_000.0
KEPT_METRICS = ("completed", "rejected", "failed", "unfinished", "not_sent", "duration", "request_throughput",
                "output_throughput", "request_goodput", "median_tbt_ms", "p90_tbt_ms", "p99_tbt_ms",
                "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p90_itl_ms", "median_tpot_ms")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="embedded:smollm2", help="model source (default: the embedded SmolLM2)")
    parser.add_argument("--rates", default="0.15,0.3,0.5",
                        help="request rates (req/s), comma-separated (defaults sized for SmolLM2 on 1 CPU thread per "
                        "instance: a 2k-token document prefills in ~8 s, a decode step takes ~0.1 s)")
    parser.add_argument("--duration-s", type=float, default=80.0, help="arrivals span this long per rate")
    parser.add_argument("--tail-s", type=float, default=40.0, help="a rate's run ends this long after arrivals")
    parser.add_argument("--max-requests", type=int, default=60, help="cap on requests per rate")
    parser.add_argument("--chat-tokens", type=int, default=100, help="prompt tokens of a chat")
    parser.add_argument("--doc-tokens", type=int, default=2000, help="prompt tokens of a long document")
    parser.add_argument("--doc-every", type=int, default=5, help="every n-th request is a long document")
    parser.add_argument("--output-tokens", type=int, default=64, help="output tokens of every request")
    parser.add_argument("--disagg-inline-max-tokens", type=int, default=0,
                        help="disaggregated layout's worker.inline_prefill_max_tokens (0: every prompt goes to the "
                        "prefill instance; 256, the config default, prefills short chats on the decode instance)")
    parser.add_argument("--admission", default="none",
                        choices=("none", "baseline", "early_rejection", "early_rejection_predicted"),
                        help="scheduler.admission of both layouts; with none the cluster's SLOs are also lifted "
                        "(no 429s: every request is served and measured)")
    parser.add_argument("--tbt-slo-ms", type=float, default=None, help="TBT SLO for goodput (default: factor x "
                        "the unloaded median inter-token latency)")
    parser.add_argument("--tbt-slo-factor", type=float, default=5.0)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="which layouts to run, in this order")
    parser.add_argument("--start-timeout-s", type=float, default=240.0, help="deadline for GET /health")
    parser.add_argument("--vocab-size", type=int, default=49152, help="prompt token ids are drawn below this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--json", help="write the result here")


def workload(args: argparse.Namespace, rate: float) -> tuple[BenchRequest, ...]:
    """The rate's requests: Poisson arrivals within --duration-s, every --doc-every-th a long document."""
    num_requests = min(args.max_requests, max(1, math.ceil(rate * args.duration_s)))
    arrivals = [t for t in poisson_arrivals(num_requests, rate, args.seed) if t < args.duration_s]
    blocks = TokenBlocks(block_tokens=64, vocab_size=args.vocab_size, seed=args.seed)
    return tuple(BenchRequest(index=i, arrival_s=t, token_ids=blocks.random_tokens(_prompt_len(args, i), (i, -3)),
                              max_tokens=args.output_tokens)
                 for i, t in enumerate(arrivals))


def _prompt_len(args: argparse.Namespace, index: int) -> int:
    return args.doc_tokens if index % args.doc_every == args.doc_every - 1 else args.chat_tokens


def _probe_requests(args: argparse.Namespace) -> tuple[BenchRequest, ...]:
    blocks = TokenBlocks(block_tokens=64, vocab_size=args.vocab_size, seed=args.seed + 1)
    lengths = (args.chat_tokens, args.doc_tokens, args.chat_tokens)
    return tuple(BenchRequest(index=i, arrival_s=0.0, token_ids=blocks.random_tokens(n, (i, -4)),
                              max_tokens=args.output_tokens) for i, n in enumerate(lengths))


def layout_config(tmp: Path, layout: str, args: argparse.Namespace) -> tuple[Path, str]:
    """The YAML of one layout and its conductor's URL."""
    conductor = instance("c0", "conductor")
    workers = ([instance("p0", "prefill"), instance("d0", "decode")] if layout == "disaggregated"
               else [instance("d0", "decode"), instance("d1", "decode")])
    max_model_len = args.doc_tokens + args.output_tokens + 64
    worker: dict[str, Any] = {"num_kv_pages": 256, "max_batch_tokens": max(args.doc_tokens, 256),
                              "prefill_chunk": max(args.doc_tokens, 256)}
    worker["inline_prefill_max_tokens"] = (max_model_len if layout == "colocated"  # every prompt inline
                                           else args.disagg_inline_max_tokens)
    sections: dict[str, dict[str, Any]] = {
        "model": {"source": args.model, "name": "bench-model", "max_model_len": max_model_len},
        "runtime": {"num_threads": 1, "drain_timeout_s": 5.0},
        "store": {"dram_bytes": 1 << 30, "shm_dir": str(tmp)},
        "worker": worker,
        "scheduler": {"admission": args.admission},
    }
    if args.admission == "none":  # the decode instance's own RESERVE check uses tbt_slo_ms too
        sections["scheduler"].update(tbt_slo_ms=NO_SLO_MS, ttft_slo_ms=NO_SLO_MS)
    instances = [conductor, instance("s0", "store"), *workers]
    path = write_config(tmp / f"{layout}.yaml", f"bench-pd-{layout}", instances, sections)
    return path, f"http://127.0.0.1:{conductor['port']}"


def _serve_config(url: str, requests: tuple[BenchRequest, ...], duration_s: float, slos_ms: dict[str, float],
                  show_progress: bool, max_concurrency: int | None = None) -> ServeBenchConfig:
    return ServeBenchConfig(url=url, endpoint="completions", model=None, api_key=None, requests=requests,
                            max_concurrency=max_concurrency, timeout_s=duration_s, duration_s=duration_s,
                            slos_ms=slos_ms, show_progress=show_progress)


def _kept(result: dict[str, Any], doc_tokens: int) -> dict[str, Any]:
    """The summary fields worth comparing, plus TTFT p90 of chats and of documents separately."""
    kept = {name: result[name] for name in KEPT_METRICS if name in result}
    kept["num_requests"] = result["num_prompts"]
    kept["num_good"] = round(result.get("request_goodput", 0.0) * result["duration"])  # completed within the SLO
    rows = [(n, t) for n, t, e in zip(result["input_lens"], result["ttfts_ms"], result["errors"]) if not e]
    for kind, is_doc in (("chat", False), ("doc", True)):
        values = [t for n, t in rows if (n >= doc_tokens) == is_doc]
        kept[f"p90_ttft_{kind}_ms"] = float(np.percentile(values, 90)) if values else None
    kept["errors"] = sorted({e for e in result["errors"] if e})[:5]
    return kept


async def _probe(url: str, args: argparse.Namespace, cluster: ClusterProcess) -> dict[str, float]:
    """A chat, a document and a chat, one at a time: the unloaded latencies (and the warm-up)."""
    requests = _probe_requests(args)
    probe = await run_benchmark(_serve_config(url, requests, 600.0, {}, False, max_concurrency=1))
    if probe["completed"] != len(requests):
        raise RuntimeError(f"the unloaded probe failed: {probe['errors']}\n{cluster.log_tail()}")
    ttfts_ms = {n: t for n, t in zip(probe["input_lens"], probe["ttfts_ms"])}
    return {"median_itl_ms": probe["median_itl_ms"], "chat_ttft_ms": ttfts_ms[args.chat_tokens],
            "doc_ttft_ms": ttfts_ms[args.doc_tokens]}


async def run_layout(layout: str, args: argparse.Namespace, rates: list[float], tmp: Path,
                     tbt_slo_ms: float | None) -> tuple[dict[str, Any], float]:
    """Start the layout's cluster, probe it unloaded, run every rate, stop it; (result, the TBT SLO used)."""
    config_path, url = layout_config(tmp, layout, args)
    cluster = ClusterProcess(config_path, url, tmp / f"{layout}.log")
    await cluster.start(args.start_timeout_s)
    try:
        result: dict[str, Any] = {"probe": await _probe(url, args, cluster), "rates": {}}
        if tbt_slo_ms is None:
            tbt_slo_ms = args.tbt_slo_factor * result["probe"]["median_itl_ms"]
        for i, rate in enumerate(rates):
            if i > 0:
                await asyncio.sleep(2.0)  # the previous rate's cancelled stragglers leave the batch first
            requests = workload(args, rate)
            run = await run_benchmark(_serve_config(url, requests, args.duration_s + args.tail_s,
                                                    {"tbt": tbt_slo_ms}, not args.no_progress))
            result["rates"][f"{rate:g}"] = _kept(run, args.doc_tokens)
    finally:
        result_code = await cluster.stop(timeout_s=60.0)
    result["clean_exit"] = result_code == 0
    return result, tbt_slo_ms


async def _bench(args: argparse.Namespace, rates: list[float], layouts: list[str]) -> dict[str, Any]:
    result: dict[str, Any] = {"model": args.model, "rates": rates, "workload": {
        "chat_tokens": args.chat_tokens, "doc_tokens": args.doc_tokens, "doc_every": args.doc_every,
        "output_tokens": args.output_tokens, "duration_s": args.duration_s, "tail_s": args.tail_s,
        "max_requests": args.max_requests, "arrivals": "poisson", "seed": args.seed,
        "disagg_inline_max_tokens": args.disagg_inline_max_tokens, "admission": args.admission}, "layouts": {}}
    tbt_slo_ms = args.tbt_slo_ms
    result["tbt_slo_basis"] = ("given" if tbt_slo_ms is not None else
                               f"{args.tbt_slo_factor:g} x unloaded median ITL of the {layouts[0]} probe")
    with tempfile.TemporaryDirectory(prefix="bench-pd-") as tmp:
        for layout in layouts:
            result["layouts"][layout], tbt_slo_ms = await run_layout(layout, args, rates, Path(tmp), tbt_slo_ms)
    result["tbt_slo_ms"] = tbt_slo_ms
    if set(LAYOUTS) <= set(layouts):
        result["comparison"] = _comparison(result["layouts"], rates)
    return result


def _comparison(layouts: dict[str, Any], rates: list[float]) -> dict[str, Any]:
    """Per rate, disaggregated / colocated ratios (None where the colocated value is 0)."""
    out: dict[str, Any] = {}
    for rate in rates:
        disagg, coloc = layouts["disaggregated"]["rates"][f"{rate:g}"], layouts["colocated"]["rates"][f"{rate:g}"]
        out[f"{rate:g}"] = {f"{name}_ratio": (disagg[name] / coloc[name] if coloc.get(name) else None)
                            for name in ("p90_tbt_ms", "p90_ttft_ms", "request_goodput")}
    return out


def format_table(result: dict[str, Any]) -> str:
    slo = result["tbt_slo_ms"]
    lines = [f"pd: {result['workload']['chat_tokens']}-token chats, every {result['workload']['doc_every']}th a "
             f"{result['workload']['doc_tokens']}-token document, {result['workload']['output_tokens']} output "
             f"tokens; goodput at TBT <= {slo:.0f} ms ({result['tbt_slo_basis']})",
             f"{'rate':>5} {'layout':>14} {'TBT p90':>9} {'TTFT p90':>9} {'chat TTFT':>9} {'doc TTFT':>9} "
             f"{'goodput':>8} {'done':>5} {'rej':>4} {'fail':>4} {'unfin':>5}"]
    for rate in result["rates"]:
        for layout, data in result["layouts"].items():
            row = data["rates"][f"{rate:g}"]
            lines.append(f"{rate:>5g} {layout:>14} {row['p90_tbt_ms']:9.0f} {row['p90_ttft_ms']:9.0f} "
                         f"{_ms(row['p90_ttft_chat_ms'])} {_ms(row['p90_ttft_doc_ms'])} "
                         f"{row.get('request_goodput', 0.0):8.3f} {row['completed']:>5} {row['rejected']:>4} "
                         f"{row['failed']:>4} {row['unfinished']:>5}")
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return f"{'-':>9}" if value is None else f"{value:9.0f}"


def run(args: argparse.Namespace) -> int:
    try:
        rates = [float(r) for r in args.rates.split(",")]
        layouts = [name.strip() for name in args.layouts.split(",")]
    except ValueError:
        print(f"bench pd: --rates must be numbers separated by commas, got {args.rates!r}")
        return 2
    if not rates or any(r <= 0 for r in rates) or any(name not in LAYOUTS for name in layouts) or not layouts:
        print(f"bench pd: rates must be positive and layouts among {', '.join(LAYOUTS)}")
        return 2
    result = asyncio.run(_bench(args, rates, layouts))
    report(result, format_table(result), args.json)
    return 0
