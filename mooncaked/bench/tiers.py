"""`mooncaked bench tiers`: TTFT of a hot prefix from each KV tier, and what each `kv.cache_dtype` costs.

1. Per cache_dtype (auto, int8, fp8_e4m3 by default), in this process: store s1 with prefill instances p1 and
   p1b on 127.0.0.1, store s2 with prefill p2 on 127.0.0.2 (the configured model, SmolLM2 by default); a warm-up
   opens every path.
2. Each round draws a fresh prompt of --tokens and times p1's PREFILL (the TTFT less the HTTP hop and the
   conductor's work) with `--hot-fraction` of its blocks (0.95; at most all but the last token's) hot in one
   tier: `device` (prefilled on p1 before: its device prefix cache holds them, and s1), `host_store` (prefilled
   on p1b before: s1 holds them, p1's pages do not), `remote_store` (prefilled on p2: s2 holds them, p1 fetches
   them over TCP), and `none` (nothing cached). Cases are interleaved round by round; the median and the spread
   (min-max) per case are kept.
3. Per cache_dtype also: bytes per block (one store object), the pool's capacity in tokens (store.dram_bytes /
   bytes per block x block size), the load time of the prefix from the host store (host_store's TTFT less
   device's: the copy the device tier skips), p1's device-tier metric, and the mean absolute logprob error of
   each next token of a fixed text against the uncompressed model (the model alone, prefilled in two chunks so
   the second reads the first's pages).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from mooncaked.bench.cluster import instance, write_config
from mooncaked.bench.prefix import PrefixBench
from mooncaked.bench.report import report
from mooncaked.config import Config, load_config
from mooncaked.engine.batch import PrefillSeq, build_prefill_batch
from mooncaked.engine.kv_pages import KVPages
from mooncaked.engine.runner import ModelRunner
from mooncaked.model.loader import LoadedModel
from mooncaked.roles.store import StoreRole
from mooncaked.roles.worker.prefill.role import PrefillRole

CASES = ("none", "device", "host_store", "remote_store")
WARM_ON = {"device": "p1", "host_store": "p1b", "remote_store": "p2"}
CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")
TEXT = ("The quick brown fox jumps over the lazy dog. In 1905 Albert Einstein published four papers that changed "
        "physics: on the photoelectric effect, Brownian motion, special relativity, and the equivalence of mass "
        "and energy. Paris is the capital of France, and Berlin is the capital of Germany.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="embedded:smollm2", help="model source (default: the embedded SmolLM2)")
    parser.add_argument("--tokens", type=int, default=2048, help="prompt length in tokens")
    parser.add_argument("--rounds", type=int, default=3, help="measurements per case (median kept)")
    parser.add_argument("--hot-fraction", type=float, default=0.95,
                        help="share of the prompt's blocks hot in the tier (1: all but the block of the last token)")
    parser.add_argument("--block-size", type=int, default=64, help="kv.block_size")
    parser.add_argument("--cache-dtypes", default=",".join(CACHE_DTYPES), help="kv.cache_dtype values to run")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, shared by the prefill instances")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="deadline of one PREFILL call")
    parser.add_argument("--json", help="write the result here")


def token_logprobs(model: LoadedModel, token_ids: list[int], cache_dtype: str, block_size: int) -> torch.Tensor:
    """log p(token i+1 | tokens ..i) for each position of `token_ids`, KV in `cache_dtype`, prefilled in two
    chunks (the second over the first's pages, as a reused prefix is)."""
    num_pages = -(-len(token_ids) // block_size)
    kv = KVPages.for_model(model.args, num_pages=num_pages, block_size=block_size, dtype=model.dtype,
                           device=model.device, cache_dtype=cache_dtype)
    runner = ModelRunner(model.model, kv, backend="torch")
    pages = list(range(num_pages))
    half = len(token_ids) // 2 // block_size * block_size
    logits = [runner.prefill(build_prefill_batch([PrefillSeq(chunk, start, pages)], block_size=block_size,
                                                 num_pages=num_pages, device=model.device), return_all_logits=True)
              for chunk, start in ((token_ids[:half], 0), (token_ids[half:], half)) if chunk]
    logprobs = torch.cat(logits).float().log_softmax(-1)
    return logprobs[torch.arange(len(token_ids) - 1), torch.tensor(token_ids[1:])]


def logprob_error(model: LoadedModel, token_ids: list[int], cache_dtype: str, block_size: int) -> float:
    """Mean absolute difference, in nats per token, from the uncompressed (`auto`) KV's logprobs."""
    exact = token_logprobs(model, token_ids, "auto", block_size)
    return float((token_logprobs(model, token_ids, cache_dtype, block_size) - exact).abs().mean())


def _config(tmp: Path, args: argparse.Namespace, cache_dtype: str) -> Config:
    instances = [instance("s1", "store", "127.0.0.1"), instance("p1", "prefill", "127.0.0.1"),
                 instance("p1b", "prefill", "127.0.0.1"), instance("s2", "store", "127.0.0.2"),
                 instance("p2", "prefill", "127.0.0.2")]
    num_blocks = -(-args.tokens // args.block_size)
    sections = {
        "model": {"source": args.model, "max_model_len": args.tokens + 16},
        "kv": {"block_size": args.block_size, "cache_dtype": cache_dtype},
        "store": {"dram_bytes": 1 << 30, "shm_dir": str(tmp)},
        # room for the prompt and every earlier round's cached prefixes: the device tier evicts none mid-run
        "worker": {"num_kv_pages": (2 * args.rounds + 4) * num_blocks + 4, "prefill_chunk": args.tokens,
                   "max_batch_tokens": args.tokens},
        "transfer": {"timeout_s": args.timeout_s},
    }
    path = write_config(tmp / f"bench-tiers-{cache_dtype}.yaml", f"bench-tiers-{cache_dtype}", instances, sections)
    return load_config(path)


class TiersBench(PrefixBench):
    """PrefixBench's clients and PREFILL calls, measuring a prompt hot in one tier (WARM_ON)."""

    name = "bench-tiers"

    async def measure_tier(self, case: str, num_tokens: int, hot_fraction: float) -> dict[str, Any]:
        tokens = self.fresh_prompt(num_tokens)
        num_blocks = -(-num_tokens // self.block_size)
        num_hot = min(round(hot_fraction * num_blocks), (num_tokens - 1) // self.block_size) if case != "none" else 0
        if num_hot:
            await self.prefill(WARM_ON[case], tokens[: num_hot * self.block_size])
        fetch = ("s2", num_hot) if case == "remote_store" else ("", 0)
        elapsed_s, reply = await self.prefill("p1", tokens, *fetch)
        return {"ttft_s": elapsed_s, "num_hot_blocks": num_hot, "num_reused_tokens": reply.num_cached_tokens,
                "num_fetched_blocks": reply.num_fetched_blocks}

    async def warm_up(self) -> None:
        tokens = self.fresh_prompt(2 * self.block_size + 1)
        await self.prefill("p2", tokens)
        await self.prefill("p1b", tokens)
        await self.prefill("p1", tokens, "s2", 2)


async def _run_dtype(args: argparse.Namespace, cache_dtype: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        config = _config(Path(tmp), args, cache_dtype)
        roles: list[StoreRole | PrefillRole] = [StoreRole(config, config.instance_named(n)) for n in ("s1", "s2")]
        prefills = {n: PrefillRole(config, config.instance_named(n)) for n in ("p1", "p1b", "p2")}
        roles += list(prefills.values())
        started: list[StoreRole | PrefillRole] = []
        try:
            for role in roles:
                await role.start()
                started.append(role)
            bench = TiersBench(config, prefills["p1"], args.timeout_s)
            try:
                result = await _measure(bench, args)
            finally:
                await bench.close()
            p1 = prefills["p1"]
            assert p1.worker.loaded is not None
            device = p1.metrics.registry.get_sample_value("mooncaked_device_prefix_blocks_total") or 0.0
            text_ids = p1.worker.loaded.tokenizer.encode(TEXT)
            error = await p1.worker.compute(logprob_error, p1.worker.loaded, text_ids, cache_dtype, bench.block_size)
            block_nbytes = p1.worker.block_nbytes
            return {**result, "cache_dtype": cache_dtype, "bytes_per_block": block_nbytes,
                    "pool_tokens": config.store.dram_bytes // block_nbytes * bench.block_size,
                    "device_prefix_blocks": device, "logprob_error_nats": error, "text_tokens": len(text_ids)}
        finally:
            for role in reversed(started):
                await role.stop()


async def _measure(bench: TiersBench, args: argparse.Namespace) -> dict[str, Any]:
    await bench.warm_up()
    runs: dict[str, list[dict[str, Any]]] = {case: [] for case in CASES}
    for _ in range(args.rounds):
        for case in CASES:
            runs[case].append(await bench.measure_tier(case, args.tokens, args.hot_fraction))
    cases: dict[str, Any] = {}
    for case in CASES:
        times = [run["ttft_s"] for run in runs[case]]
        cases[case] = {"ttft_s": statistics.median(times), "ttft_s_min": min(times), "ttft_s_max": max(times),
                       "ttft_s_runs": times, "num_hot_blocks": runs[case][-1]["num_hot_blocks"],
                       "num_reused_tokens": min(run["num_reused_tokens"] for run in runs[case]),
                       "num_fetched_blocks": min(run["num_fetched_blocks"] for run in runs[case])}
    return {"cases": cases, "load_s": cases["host_store"]["ttft_s"] - cases["device"]["ttft_s"]}


def format_table(result: dict[str, Any]) -> str:
    lines = [f"KV tiers: {result['num_tokens']}-token prompt, {result['hot_fraction']:.0%} hot, "
             f"blocks of {result['block_size']}, "
             f"median (min-max) of {result['rounds']}"]
    for run in result["runs"]:
        lines.append(f"cache_dtype {run['cache_dtype']}: {run['bytes_per_block']} bytes/block, pool "
                     f"{run['pool_tokens']} tokens per GiB, load from the host store {run['load_s'] * 1e3:.1f} ms, "
                     f"logprob error {run['logprob_error_nats']:.4f} nats/token, device-tier blocks "
                     f"{run['device_prefix_blocks']:.0f}")
        for case, row in run["cases"].items():
            lines.append(f"  {case:>12}: TTFT {row['ttft_s'] * 1e3:8.1f} ms ({row['ttft_s_min'] * 1e3:.1f}-"
                         f"{row['ttft_s_max'] * 1e3:.1f}), reused {row['num_reused_tokens']} tokens, fetched "
                         f"{row['num_fetched_blocks']} blocks")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    cache_dtypes = [d for d in args.cache_dtypes.split(",") if d]
    if args.tokens < 2 * args.block_size or args.rounds < 1 or args.threads < 1 or not cache_dtypes or any(
            d not in CACHE_DTYPES for d in cache_dtypes) or not 0.0 < args.hot_fraction <= 1.0:
        print(f"bench tiers: --tokens must be at least 2 blocks, --rounds and --threads >= 1, --hot-fraction in "
              f"(0, 1], --cache-dtypes of {', '.join(CACHE_DTYPES)}")
        return 2
    torch.set_num_threads(args.threads)
    runs = [asyncio.run(_run_dtype(args, cache_dtype)) for cache_dtype in cache_dtypes]
    result = {"model": args.model, "num_tokens": args.tokens, "block_size": args.block_size, "rounds": args.rounds,
              "threads": args.threads, "hot_fraction": args.hot_fraction, "runs": runs}
    report(result, format_table(result), args.json)
    return 0
