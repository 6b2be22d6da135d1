"""`mooncaked bench prefix`: TTFT of one long prompt with 0%, 50% and 95% of its blocks already cached, the
cache in this host's store (local) or in another host's store (remote, fetched over TCP; paper section 3.3,
Algorithm 1's remote-prefix path).

1. Start, in this process, store s1 + prefill p1 on 127.0.0.1 and store s2 + prefill p2 on 127.0.0.2, with the
   configured model (SmolLM2 by default); a warm-up prefill on each and one remote fetch open the connections.
2. Every measurement draws a fresh random prompt, so only the intended prefix is cached anywhere. To cache k of
   its blocks, the first k * block_size tokens are prefilled first: on p1 (local case, the blocks land in s1)
   or on p2 (remote case, they land in s2; p1 is then told `fetch_store="s2", num_fetch_blocks=k`).
3. The measured quantity is the PREFILL RPC's latency as the conductor sees it (TTFT minus the HTTP hop and the
   conductor's own work): fetch, prefix load, compute of the uncached tokens, KV stores, commit, first token.
4. Cases are interleaved round by round; the median per case is kept, with its `ratio` to the 0% case and the
   blocks actually reused and fetched.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mooncaked.bench.cluster import instance, write_config
from mooncaked.bench.report import report
from mooncaked.config import Config, InstanceConfig, load_config
from mooncaked.kv.keys import block_keys
from mooncaked.roles.base import PeerClients
from mooncaked.roles.store import StoreRole
from mooncaked.roles.worker.messages import PREFILL, PrefillReply, PrefillRequest, SamplingSpec
from mooncaked.roles.worker.prefill.role import PrefillRole
from mooncaked.rpc import RpcClient


@dataclass(frozen=True)
class Case:
    where: str  # "local": the prefix is in p1's own store; "remote": in s2, fetched by p1 over TCP
    cached_fraction: float

    @property
    def name(self) -> str:
        return f"{self.where}_{round(self.cached_fraction * 100)}"


CASES = (Case("local", 0.0), Case("local", 0.5), Case("local", 0.95), Case("remote", 0.5), Case("remote", 0.95))
BASELINE = CASES[0]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="embedded:smollm2", help="model source (default: the embedded SmolLM2)")
    parser.add_argument("--tokens", type=int, default=2048, help="prompt length in tokens")
    parser.add_argument("--rounds", type=int, default=3, help="measurements per case (median kept)")
    parser.add_argument("--block-size", type=int, default=64, help="kv.block_size")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, shared by both prefill instances "
                        "(they never compute at once); 1 keeps timings steady on a busy host")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="deadline of one PREFILL call")
    parser.add_argument("--json", help="write the result here")


def _config(tmp: Path, args: argparse.Namespace) -> Config:
    instances = [instance("s1", "store", "127.0.0.1"), instance("p1", "prefill", "127.0.0.1"),
                 instance("s2", "store", "127.0.0.2"), instance("p2", "prefill", "127.0.0.2")]
    num_blocks = -(-args.tokens // args.block_size)
    sections = {
        "model": {"source": args.model, "max_model_len": args.tokens + 16},
        "kv": {"block_size": args.block_size},
        "store": {"dram_bytes": 2 << 30, "shm_dir": str(tmp)},
        "worker": {"num_kv_pages": 2 * num_blocks + 4, "prefill_chunk": args.tokens,
                   "max_batch_tokens": args.tokens},
        "transfer": {"timeout_s": args.timeout_s},
    }
    return load_config(write_config(tmp / "bench-prefix.yaml", "bench-prefix", instances, sections))


class PrefixBench:
    """Owns the RPC clients of one run and its random source; the roles are owned by `_bench`."""

    name = "bench-prefix"  # the RPC clients' instance name and the request ids' prefix

    def __init__(self, config: Config, p1: PrefillRole, timeout_s: float) -> None:
        self.config = config
        self.block_size = config.kv.block_size
        self.namespace = p1.worker.namespace
        assert p1.worker.loaded is not None
        self.vocab_size = p1.worker.loaded.args.vocab_size
        self.timeout_s = timeout_s
        self.peers = PeerClients(config, InstanceConfig(name=self.name, role="conductor"))
        self.rng = random.Random(0)
        self.num_calls = 0

    def client(self, name: str) -> RpcClient:
        return self.peers.for_instance(self.config.instance_named(name))

    async def prefill(self, instance_name: str, tokens: list[int], fetch_store: str = "",
                      num_fetch_blocks: int = 0) -> tuple[float, PrefillReply]:
        self.num_calls += 1
        request = PrefillRequest(f"{self.name}-{self.num_calls}", tokens,
                                 block_keys(tokens, self.block_size, self.namespace),
                                 SamplingSpec(max_tokens=1, temperature=0.0),
                                 fetch_store=fetch_store, num_fetch_blocks=num_fetch_blocks)
        started = time.perf_counter()
        reply = await self.client(instance_name).call(PREFILL, request, timeout_s=self.timeout_s)
        return time.perf_counter() - started, reply

    def fresh_prompt(self, num_tokens: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab_size) for _ in range(num_tokens)]

    async def measure(self, case: Case, num_tokens: int) -> dict[str, Any]:
        """One measurement of `case`: warm k blocks where the case says, then time p1's PREFILL."""
        tokens = self.fresh_prompt(num_tokens)
        num_blocks = -(-num_tokens // self.block_size)
        num_cached_blocks = min(round(case.cached_fraction * num_blocks), (num_tokens - 1) // self.block_size)
        if num_cached_blocks:
            await self.prefill("p1" if case.where == "local" else "p2", tokens[:num_cached_blocks * self.block_size])
        fetch = ("s2", num_cached_blocks) if case.where == "remote" and num_cached_blocks else ("", 0)
        elapsed_s, reply = await self.prefill("p1", tokens, *fetch)
        return {"ttft_s": elapsed_s, "num_cached_blocks": num_cached_blocks,
                "num_reused_tokens": reply.num_cached_tokens, "num_fetched_blocks": reply.num_fetched_blocks,
                "server_prefill_s": reply.prefill_s}

    async def warm_up(self) -> None:
        """Load paths, open the store and transfer connections both ways (p1 -> s2 included)."""
        tokens = self.fresh_prompt(2 * self.block_size + 1)
        await self.prefill("p2", tokens)
        await self.prefill("p1", tokens, "s2", 2)

    async def close(self) -> None:
        await self.peers.close()


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        config = _config(Path(tmp), args)
        stores = [StoreRole(config, config.instance_named(n)) for n in ("s1", "s2")]
        prefills = [PrefillRole(config, config.instance_named(n)) for n in ("p1", "p2")]
        started: list[StoreRole | PrefillRole] = []
        roles: list[StoreRole | PrefillRole] = [*stores, *prefills]
        try:
            for role in roles:
                await role.start()
                started.append(role)
            bench = PrefixBench(config, prefills[0], args.timeout_s)
            try:
                return await _measure(bench, args)
            finally:
                await bench.close()
        finally:
            for role in reversed(started):
                await role.stop()


async def _measure(bench: PrefixBench, args: argparse.Namespace) -> dict[str, Any]:
    await bench.warm_up()
    runs: dict[str, list[dict[str, Any]]] = {case.name: [] for case in CASES}
    for _ in range(args.rounds):
        for case in CASES:
            runs[case.name].append(await bench.measure(case, args.tokens))
    baseline_s = statistics.median(run["ttft_s"] for run in runs[BASELINE.name])
    cases: dict[str, Any] = {}
    for case in CASES:
        ttft_s = statistics.median(run["ttft_s"] for run in runs[case.name])
        last = runs[case.name][-1]
        cases[case.name] = {
            "where": case.where, "cached_fraction": case.cached_fraction,
            "num_cached_blocks": last["num_cached_blocks"],
            "num_reused_tokens": min(run["num_reused_tokens"] for run in runs[case.name]),
            "num_fetched_blocks": min(run["num_fetched_blocks"] for run in runs[case.name]),
            "ttft_s": ttft_s, "ratio": ttft_s / baseline_s,
            "ttft_s_runs": [run["ttft_s"] for run in runs[case.name]],
            "server_prefill_s": statistics.median(run["server_prefill_s"] for run in runs[case.name]),
        }
    return {"model": args.model, "num_tokens": args.tokens, "block_size": bench.block_size,
            "num_blocks": -(-args.tokens // bench.block_size), "rounds": args.rounds, "threads": args.threads,
            "cases": cases, "ratio_local_95": cases["local_95"]["ratio"],
            "ratio_remote_95": cases["remote_95"]["ratio"]}


def format_table(result: dict[str, Any]) -> str:
    lines = [f"prefix reuse: {result['num_tokens']}-token prompt, {result['num_blocks']} blocks of "
             f"{result['block_size']}, median of {result['rounds']}",
             f"{'case':>10} {'cached blk':>10} {'reused tok':>10} {'fetched blk':>11} {'ttft ms':>9} {'ratio':>6}"]
    for name, row in result["cases"].items():
        lines.append(f"{name:>10} {row['num_cached_blocks']:>10} {row['num_reused_tokens']:>10} "
                     f"{row['num_fetched_blocks']:>11} {row['ttft_s'] * 1e3:9.1f} {row['ratio']:6.3f}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.tokens < 2 * args.block_size or args.rounds < 1 or args.threads < 1:
        print("bench prefix: --tokens must be at least 2 blocks, --rounds and --threads >= 1")
        return 2
    result = asyncio.run(_bench(args))
    report(result, format_table(result), args.json)
    return 0
