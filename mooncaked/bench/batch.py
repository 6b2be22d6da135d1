"""`mooncaked bench batch`: interactive latency alone and with a Batch API batch filling the idle capacity.

1. One cluster on this host (a store, 1 prefill + 1 decode instance with one compute thread each, a conductor
   with `conductor.batch_dir`), SLOs `--ttft-slo-ms` / `--tbt-slo-ms`, admission `none` (no interactive request
   is rejected: every one is measured), batch lines admitted with `--batch-slo-margin` headroom.
2. Per repeat, on the warm cluster: `alone`, interactive chats (`--chat-tokens`, `--output-tokens`) arriving as a
   Poisson process at `--rate` for `--duration-s`; then `with_batch`, the same arrivals and lengths (other
   prompts: nothing is served from the first run's cache), with a `--batch-lines`-line batch uploaded and
   created at its start (each line an instruction of `--batch-prefix-tokens` shared by all, as a batch job's
   lines usually are, then its own `--batch-prompt-tokens`). The run lasts `--duration-s` plus `--tail-s`; the
   batch must finish in it (one that did not is cancelled before the next repeat).
3. Report per repeat and as median (min..max) over repeats: interactive TTFT p90 and TBT p90 in both runs and
   their ratios (`interactive_ttft_p90_ratio`, `interactive_tbt_p90_ratio`: with batch / alone; target <= 1.2),
   the batch's lines per second and whether it finished within the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from mooncaked.bench.cluster import ClusterProcess, instance, write_config
from mooncaked.bench.report import report
from mooncaked.bench.serve import ServeBenchConfig, run_benchmark
from mooncaked.bench.trace import BenchRequest, TokenBlocks, poisson_arrivals

TARGET_RATIO = 1.2
TERMINAL = ("completed", "failed", "expired", "cancelled")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="embedded:smollm2", help="model source (default: the embedded SmolLM2)")
    parser.add_argument("--rate", type=float, default=0.5, help="interactive requests per second (Poisson)")
    parser.add_argument("--duration-s", type=float, default=90.0, help="interactive arrivals span this long")
    parser.add_argument("--tail-s", type=float, default=90.0, help="a run ends this long after the last arrival")
    parser.add_argument("--chat-tokens", type=int, default=100, help="prompt tokens of an interactive chat")
    parser.add_argument("--output-tokens", type=int, default=32, help="output tokens of an interactive chat")
    parser.add_argument("--batch-lines", type=int, default=200)
    parser.add_argument("--batch-prefix-tokens", type=int, default=64,
                        help="an instruction every batch line starts with (cached after the first line)")
    parser.add_argument("--batch-prompt-tokens", type=int, default=16, help="tokens of each line after the prefix")
    parser.add_argument("--batch-output-tokens", type=int, default=16)
    parser.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    parser.add_argument("--tbt-slo-ms", type=float, default=500.0)
    parser.add_argument("--batch-max-in-flight", type=int, default=2)
    parser.add_argument("--batch-slo-margin", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=1, help="alone/with-batch pairs on the same cluster")
    parser.add_argument("--start-timeout-s", type=float, default=240.0)
    parser.add_argument("--vocab-size", type=int, default=49152, help="prompt token ids are drawn below this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--json", help="write the result here")


def interactive_requests(args: argparse.Namespace, seed: int) -> tuple[BenchRequest, ...]:
    """Poisson arrivals of `--seed` (the same in both runs of a repeat); prompts of `seed` (new every run)."""
    num = max(1, math.ceil(args.rate * args.duration_s))
    arrivals = [t for t in poisson_arrivals(num, args.rate, args.seed) if t < args.duration_s]
    blocks = TokenBlocks(block_tokens=64, vocab_size=args.vocab_size, seed=seed)
    return tuple(BenchRequest(i, t, blocks.random_tokens(args.chat_tokens, (i, -5)), args.output_tokens)
                 for i, t in enumerate(arrivals))


def batch_file(args: argparse.Namespace, seed: int) -> bytes:
    blocks = TokenBlocks(block_tokens=64, vocab_size=args.vocab_size, seed=seed)
    prefix = list(blocks.random_tokens(args.batch_prefix_tokens, (-7,)))
    lines = []
    for i in range(args.batch_lines):
        body = {"prompt": prefix + list(blocks.random_tokens(args.batch_prompt_tokens, (i, -6))),
                "max_tokens": args.batch_output_tokens, "ignore_eos": True, "temperature": 0.0}
        lines.append(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                                 "body": body}))
    return ("\n".join(lines) + "\n").encode()


def cluster_config(tmp: Path, args: argparse.Namespace) -> tuple[Path, str]:
    conductor = instance("c0", "conductor")
    max_model_len = max(args.chat_tokens + args.output_tokens,
                        args.batch_prefix_tokens + args.batch_prompt_tokens + args.batch_output_tokens)
    sections: dict[str, dict[str, Any]] = {
        "model": {"source": args.model, "name": "bench-model", "max_model_len": max_model_len + 64},
        "runtime": {"num_threads": 1, "drain_timeout_s": 5.0},
        "store": {"dram_bytes": 1 << 30, "shm_dir": str(tmp)},
        "worker": {"num_kv_pages": 512, "inline_prefill_max_tokens": 0},
        "scheduler": {"admission": "none", "ttft_slo_ms": args.ttft_slo_ms, "tbt_slo_ms": args.tbt_slo_ms},
        "conductor": {"batch_dir": str(tmp / "batches"), "batch_max_in_flight": args.batch_max_in_flight,
                      "batch_slo_margin": args.batch_slo_margin, "request_timeout_s": 600.0},
    }
    instances = [conductor, instance("s0", "store"), instance("p0", "prefill"), instance("d0", "decode")]
    return write_config(tmp / "batch.yaml", "bench-batch", instances, sections), f"http://127.0.0.1:{conductor['port']}"


def _serve_config(args: argparse.Namespace, url: str, requests: tuple[BenchRequest, ...]) -> ServeBenchConfig:
    run_s = args.duration_s + args.tail_s
    return ServeBenchConfig(url=url, endpoint="completions", model=None, api_key=None, requests=requests,
                            max_concurrency=None, timeout_s=run_s, duration_s=run_s, slos_ms={},
                            show_progress=not args.no_progress)


def _kept(result: dict[str, Any]) -> dict[str, Any]:
    names = ("completed", "failed", "rejected", "unfinished", "p90_ttft_ms", "median_ttft_ms", "p90_tbt_ms",
             "median_tbt_ms", "p90_itl_ms", "duration")
    return {name: result.get(name) for name in names}


async def _submit_batch(http: aiohttp.ClientSession, url: str, data: bytes) -> str:
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", data, filename="batch.jsonl", content_type="application/jsonl")
    async with http.post(f"{url}/v1/files", data=form) as response:
        uploaded = await response.json()
        if response.status != 200:
            raise RuntimeError(f"upload failed: {uploaded}")
    body = {"input_file_id": uploaded["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
    async with http.post(f"{url}/v1/batches", json=body) as response:
        created = await response.json()
        if response.status != 200:
            raise RuntimeError(f"batch create failed: {created}")
    return str(created["id"])


async def _watch_batch(http: aiohttp.ClientSession, url: str, batch_id: str, started: float,
                       deadline: float) -> dict[str, Any]:
    """Poll until the batch ends or `deadline` (monotonic) passes; its last state and when it ended."""
    batch: dict[str, Any] = {}
    while time.monotonic() < deadline:
        async with http.get(f"{url}/v1/batches/{batch_id}") as response:
            batch = await response.json()
        if batch.get("status") in TERMINAL:
            return {"status": batch["status"], "finished_after_s": time.monotonic() - started,
                    "request_counts": batch["request_counts"]}
        await asyncio.sleep(0.5)
    return {"status": batch.get("status"), "finished_after_s": None, "request_counts": batch.get("request_counts")}


async def run_pair(args: argparse.Namespace, url: str, repeat: int) -> dict[str, Any]:
    alone = await run_benchmark(_serve_config(args, url, interactive_requests(args, seed=1000 + 2 * repeat)))
    await asyncio.sleep(2.0)
    async with aiohttp.ClientSession() as http:
        started = time.monotonic()
        batch_id = await _submit_batch(http, url, batch_file(args, seed=3000 + repeat))
        run_s = args.duration_s + args.tail_s
        watch = asyncio.ensure_future(_watch_batch(http, url, batch_id, started, started + run_s))
        with_batch = await run_benchmark(_serve_config(args, url, interactive_requests(args, seed=1001 + 2 * repeat)))
        interactive_s = time.monotonic() - started
        batch = await watch
        if batch["status"] not in TERMINAL:  # the next repeat's `alone` run must have the cluster to itself
            async with http.post(f"{url}/v1/batches/{batch_id}/cancel") as response:
                response.raise_for_status()
            await _watch_batch(http, url, batch_id, started, time.monotonic() + args.tail_s)
    done_s = batch["finished_after_s"]
    counts = batch["request_counts"] or {}
    pair: dict[str, Any] = {"alone": _kept(alone), "with_batch": _kept(with_batch), "batch": {
        **batch, "lines_per_s": counts.get("completed", 0) / done_s if done_s else None,
        "finished_within_run": batch["status"] == "completed" and done_s is not None and done_s <= run_s,
        "interactive_run_s": interactive_s}}
    for name in ("ttft", "tbt"):
        base = alone[f"p90_{name}_ms"]
        pair[f"interactive_{name}_p90_ratio"] = with_batch[f"p90_{name}_ms"] / base if base else None
    return pair


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    kept_args = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str)) and k != "json"}
    result: dict[str, Any] = {"args": kept_args,
                              "load_average_start": os.getloadavg(), "repeats": []}
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as tmp:
        config_path, url = cluster_config(Path(tmp), args)
        cluster = ClusterProcess(config_path, url, Path(tmp) / "cluster.log")
        await cluster.start(args.start_timeout_s)
        try:
            for repeat in range(args.repeats):
                result["repeats"].append(await run_pair(args, url, repeat))
        finally:
            result["clean_exit"] = await cluster.stop(timeout_s=60.0) == 0
    result["load_average_end"] = os.getloadavg()
    pairs = result["repeats"]
    result["summary"] = {
        name: _spread([p[name] for p in pairs if p[name] is not None])
        for name in ("interactive_ttft_p90_ratio", "interactive_tbt_p90_ratio")}
    result["summary"]["batch_lines_per_s"] = _spread([p["batch"]["lines_per_s"] for p in pairs
                                                      if p["batch"]["lines_per_s"] is not None])
    result["summary"]["batches_finished_within_run"] = sum(p["batch"]["finished_within_run"] for p in pairs)
    return result


def format_table(result: dict[str, Any]) -> str:
    args = result["args"]
    lines = [f"batch: interactive {args['chat_tokens']}-token chats at {args['rate']:g}/s for {args['duration_s']:g} s "
             f"({args['output_tokens']} output tokens); batch of {args['batch_lines']} lines "
             f"({args['batch_prefix_tokens']} shared + {args['batch_prompt_tokens']} + {args['batch_output_tokens']} "
             f"tokens, {args['batch_max_in_flight']} in flight); load average "
             f"{result['load_average_start'][0]:.1f} -> {result['load_average_end'][0]:.1f}",
             f"{'run':>4} {'TTFT p90 alone':>15} {'with batch':>11} {'ratio':>6} {'TBT p90 alone':>14} "
             f"{'with batch':>11} {'ratio':>6} {'lines/s':>8} {'batch':>10} {'in run':>6}"]
    for i, pair in enumerate(result["repeats"]):
        alone, both, batch = pair["alone"], pair["with_batch"], pair["batch"]
        lines.append(f"{i:>4} {alone['p90_ttft_ms']:15.0f} {both['p90_ttft_ms']:11.0f} "
                     f"{_ratio(pair['interactive_ttft_p90_ratio'])} {alone['p90_tbt_ms']:14.0f} "
                     f"{both['p90_tbt_ms']:11.0f} {_ratio(pair['interactive_tbt_p90_ratio'])} "
                     f"{batch['lines_per_s'] or 0.0:8.2f} {batch['status']:>10} {str(batch['finished_within_run']):>6}")
    summary = result["summary"]
    for name in ("interactive_ttft_p90_ratio", "interactive_tbt_p90_ratio"):
        spread = summary[name]
        if spread is not None:
            verdict = "meets" if spread["median"] <= TARGET_RATIO else "misses"
            lines.append(f"{name}: median {spread['median']:.2f} ({spread['min']:.2f}..{spread['max']:.2f}), "
                         f"{verdict} the target <= {TARGET_RATIO}")
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return f"{'-':>6}" if value is None else f"{value:6.2f}"


def run(args: argparse.Namespace) -> int:
    if args.rate <= 0 or args.duration_s <= 0 or args.batch_lines < 1 or args.repeats < 1:
        print("bench batch: --rate, --duration-s, --batch-lines and --repeats must be positive")
        return 2
    result = asyncio.run(_bench(args))
    report(result, format_table(result), args.json)
    return 0
