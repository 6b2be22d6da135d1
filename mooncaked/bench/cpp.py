"""`mooncaked bench cpp`: a prefill group's TTFT (chunked pipeline parallelism) against one prefill instance.

1. Processes, one torch thread each (runtime.num_threads=1): a 2-stage group g0 + g1 (each holding half of the
   layers) with its store s_g on 127.0.0.1, g0 pinned to the first of `--cpus`, g1 to the second; a single
   prefill instance p0 (the whole model) with its store s_p on 127.0.0.2, pinned to the first CPU. Every
   instance is its own `python -m mooncaked --role ...` process, as in a deployment.
2. Per round and prompt length (`--lengths`, default 2k, 4k and 8k tokens): one fresh random prompt, prefilled
   once by the group (PREFILL to g0) and once by p0, in an order that alternates between rounds; nothing else
   runs meanwhile, so p0 has its core to itself and the group both. TTFT is the PREFILL call's time as the
   client sees it (planning, the forward, the KV stored in the store, the first token); both must give the
   same first token.
3. Medians over `--rounds` (3) interleaved rounds after one warm-up prompt each; the JSON has per length the
   medians, spreads and `ttft_ratio_<N>` = group / single (the target: ttft_ratio_8192 <= 0.65), plus the
   load average before and after (the machine may be shared: compare ratios, not absolute times).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from mooncaked.bench.cluster import instance, write_config
from mooncaked.bench.report import write_json
from mooncaked.bench.store_processes import instance_processes
from mooncaked.config import Config, InstanceConfig, load_config
from mooncaked.kv.cache_dtype import namespace_dtype
from mooncaked.kv.keys import block_keys, model_namespace
from mooncaked.model.frontend import load_frontend
from mooncaked.roles.base import PeerClients
from mooncaked.roles.worker.messages import PREFILL, PrefillReply, PrefillRequest, SamplingSpec
from mooncaked.runtime.cpu_affinity import check_usable, usable_cpus
from mooncaked.runtime.numa import parse_id_list

GREEDY = SamplingSpec(max_tokens=1, temperature=0.0, ignore_eos=True)
LAYOUTS = ("group", "single")
HEADS = {"group": "g0", "single": "p0"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="embedded:smollm2", help="model source (default: the embedded SmolLM2)")
    parser.add_argument("--lengths", default="2048,4096,8192", help="prompt lengths in tokens")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians)")
    parser.add_argument("--cpus", default=None, help="two CPU ids, e.g. 0,1: stage 0 (and the single instance) on "
                        "the first, stage 1 on the second (default: the first two usable)")
    parser.add_argument("--cpp-chunk-tokens", type=int, default=512, help="the group's worker.cpp_chunk_tokens")
    parser.add_argument("--prefill-chunk", type=int, default=1024, help="the single instance's worker.prefill_chunk")
    parser.add_argument("--max-model-len", type=int, default=8192, help="model.max_model_len (SmolLM2: 8192)")
    parser.add_argument("--vocab-size", type=int, default=49152, help="prompt token ids are drawn below this")
    parser.add_argument("--start-timeout-s", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the result here")


def _cpus(args: argparse.Namespace) -> list[int]:
    cpus = sorted(parse_id_list(args.cpus)) if args.cpus else sorted(usable_cpus())[:2]
    if len(cpus) != 2:
        raise ValueError(f"bench cpp needs two CPUs (one per stage), got {cpus}")
    check_usable(cpus, "bench cpp", "--cpus")
    return cpus


def _config(tmp: Path, args: argparse.Namespace, cpus: list[int], lengths: list[int]) -> tuple[Path, Config]:
    longest = max(lengths)
    instances = [instance("s_g", "store", "127.0.0.1", cpus=cpus), instance("s_p", "store", "127.0.0.2", cpus=cpus),
                 instance("g0", "prefill", "127.0.0.1", cpus=cpus[:1]),
                 instance("g1", "prefill", "127.0.0.1", cpus=cpus[1:]),
                 instance("p0", "prefill", "127.0.0.2", cpus=cpus[:1])]
    num_pages = -(-longest // 64) + 8
    sections: dict[str, dict[str, Any]] = {
        "model": {"source": args.model, "name": "bench-model", "max_model_len": args.max_model_len},
        "runtime": {"num_threads": 1, "drain_timeout_s": 5.0},
        "kv": {"block_size": 64},
        "store": {"dram_bytes": 2 << 30, "shm_dir": str(tmp)},
        "worker": {"num_kv_pages": num_pages, "prefill_chunk": args.prefill_chunk, "max_batch_tokens": longest,
                   "cpp_chunk_tokens": args.cpp_chunk_tokens, "profile_s": 0.0},
        "transfer": {"timeout_s": 600.0},
        "rpc": {"call_timeout_s": 600.0},
    }
    path = write_config(tmp / "bench-cpp.yaml", "bench-cpp", instances, sections,
                        prefill_groups=[{"name": "pg", "members": ["g0", "g1"]}])
    return path, load_config(path)


class Prompts:
    """Fresh random prompts and their block keys under the model's namespace."""

    def __init__(self, config: Config, vocab_size: int, seed: int) -> None:
        frontend = load_frontend(config.model.source)
        self.namespace = model_namespace(frontend.model_id, namespace_dtype(config.model.dtype, config.kv.cache_dtype),
                                         config.kv.block_size, frontend.args.kv_geometry)
        self.block_size = config.kv.block_size
        self.vocab_size = min(vocab_size, frontend.args.vocab_size)
        self.rng = random.Random(seed)

    def make(self, length: int) -> tuple[list[int], list[bytes]]:
        tokens = [self.rng.randrange(3, self.vocab_size) for _ in range(length)]
        return tokens, block_keys(tokens, self.block_size, self.namespace)


async def _prefill(clients: PeerClients, config: Config, layout: str, request_id: str, tokens: list[int],
                   keys: list[bytes]) -> tuple[float, PrefillReply]:
    client = clients.for_instance(config.instance_named(HEADS[layout]))
    started = time.perf_counter()
    reply: PrefillReply = await client.call(PREFILL, PrefillRequest(request_id, tokens, keys, GREEDY),
                                            timeout_s=config.rpc.call_timeout_s)
    return time.perf_counter() - started, reply


async def _measure(config: Config, args: argparse.Namespace, lengths: list[int]) -> dict[str, Any]:
    prompts = Prompts(config, args.vocab_size, args.seed)
    clients = PeerClients(config, InstanceConfig(name="bench", role="conductor"))
    times: dict[int, dict[str, list[float]]] = {n: {layout: [] for layout in LAYOUTS} for n in lengths}
    try:
        for layout in LAYOUTS:  # warm-up: connections, allocator, first-call costs
            tokens, keys = prompts.make(min(lengths))
            await _prefill(clients, config, layout, f"warm-{layout}", tokens, keys)
        for round_index in range(args.rounds):
            for length in lengths:
                tokens, keys = prompts.make(length)
                order = LAYOUTS if round_index % 2 == 0 else tuple(reversed(LAYOUTS))
                first_tokens = {}
                for layout in order:
                    seconds, reply = await _prefill(clients, config, layout, f"r{round_index}-{length}-{layout}",
                                                    tokens, keys)
                    times[length][layout].append(seconds)
                    first_tokens[layout] = reply.first_token.token_id
                if first_tokens["group"] != first_tokens["single"]:
                    raise RuntimeError(f"{length} tokens, round {round_index}: the group's first token "
                                       f"{first_tokens['group']} differs from the single instance's "
                                       f"{first_tokens['single']}")
    finally:
        await clients.close()
    return _summary(times)


def _summary(times: dict[int, dict[str, list[float]]]) -> dict[str, Any]:
    result: dict[str, Any] = {"lengths": {}}
    for length, by_layout in times.items():
        medians = {layout: statistics.median(values) for layout, values in by_layout.items()}
        result["lengths"][str(length)] = {
            **{f"{layout}_ttft_s": value for layout, value in medians.items()},
            **{f"{layout}_spread_s": max(v) - min(v) for layout, v in by_layout.items()},
            **{f"{layout}_runs_s": v for layout, v in by_layout.items()},
        }
        result[f"ttft_ratio_{length}"] = medians["group"] / medians["single"]
    return result


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.rounds < 1 or not lengths or min(lengths) < 2 or max(lengths) > args.max_model_len:
        raise ValueError("--rounds must be >= 1 and every length within 2..--max-model-len")
    cpus = _cpus(args)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-cpp-") as tmp:
        config_path, config = _config(Path(tmp), args, cpus, lengths)
        log = Path(tmp) / "cluster.log"
        async with instance_processes(config_path, config, ["s_g", "s_p"], log, args.start_timeout_s):
            async with instance_processes(config_path, config, ["g1", "g0", "p0"], log, args.start_timeout_s):
                result = await _measure(config, args, lengths)
    result["setup"] = {"model": args.model, "cpus": cpus, "num_threads": 1, "rounds": args.rounds,
                       "cpp_chunk_tokens": args.cpp_chunk_tokens, "prefill_chunk": args.prefill_chunk,
                       "num_stages": 2, "load_average_before": load_before, "load_average_after": os.getloadavg()}
    return result


def run(args: argparse.Namespace) -> int:
    try:
        result = asyncio.run(_bench(args))
    except ValueError as exc:
        print(f"bench cpp: {exc}")
        return 2
    print(f"{'tokens':>7} {'single':>9} {'group':>9} {'ratio':>6}   (median TTFT in s, spread in brackets)")
    for length, row in result["lengths"].items():
        print(f"{length:>7} {row['single_ttft_s']:9.2f} {row['group_ttft_s']:9.2f} "
              f"{result[f'ttft_ratio_{length}']:6.3f}   [{row['single_spread_s']:.2f} / {row['group_spread_s']:.2f}]")
    setup = result["setup"]
    print(f"2 stages on CPUs {setup['cpus']} vs 1 instance on CPU {setup['cpus'][0]}, 1 torch thread each, "
          f"{setup['rounds']} rounds, chunks {setup['cpp_chunk_tokens']} (group) / {setup['prefill_chunk']} (single); "
          f"load average {setup['load_average_before'][0]:.2f} before, {setup['load_average_after'][0]:.2f} after")
    if args.json:
        write_json(args.json, result)
    return 0
