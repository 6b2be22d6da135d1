"""`mooncaked bench sched`: the latency of one scheduling decision (Algorithm 1 + admission).

1. Builds a shadow index of `--num-keys` keys spread over the stores of `--num-prefill` prefill and
   `--num-decode` decode hosts (chains of 250 blocks, each on 1-3 stores, some hot chains on many).
2. Times `schedule()` for `--iterations` requests of `--prompt-blocks` blocks whose prefixes hit those chains,
   per (scheduler, admission) pair, with decode views of `--running-per-decode` running requests each.
3. Prints p50/p99 per pair and the ratio to the full KVCache-centric + prediction-based pair; `--json` writes
   them, with `p50_decision_ms` / `p99_decision_ms` of that pair at the top level (target p99 <= 1 ms).
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from typing import Any

from mooncaked.bench.report import write_json
from mooncaked.sched.algorithm import SchedulerPolicy, schedule
from mooncaked.sched.shadow_index import ShadowIndex
from mooncaked.sched.types import DecodeInstanceView, PolicyConfig, PrefillInstanceView, RequestInfo
from mooncaked.sim.config import SimConfig
from mooncaked.sim.costs import build_cost_model

_CHAIN = 250
_PAIRS = (
    ("kvcache_centric", "early_rejection_predicted"),
    ("kvcache_centric", "early_rejection"),
    ("cache_aware", "early_rejection"),
    ("load_balancing", "early_rejection"),
    ("random", "none"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prefill", type=int, default=64)
    parser.add_argument("--num-decode", type=int, default=32)
    parser.add_argument("--num-keys", type=int, default=1_000_000)
    parser.add_argument("--prompt-blocks", type=int, default=256)
    parser.add_argument("--running-per-decode", type=int, default=32)
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the result here")


def run(args: argparse.Namespace) -> int:
    if min(args.num_prefill, args.num_decode, args.num_keys, args.prompt_blocks, args.iterations) < 1:
        print("mooncaked bench sched: every count must be >= 1")
        return 2
    rng = random.Random(args.seed)
    build_started = time.perf_counter()
    index, chains = _build_index(args, rng)
    build_s = time.perf_counter() - build_started
    gc.collect()
    gc.freeze()  # the long-lived index leaves the collector's young generations, as a conductor does after start-up
    prefills = [
        PrefillInstanceView(f"prefill-{i}", f"p{i}", busy_until=rng.uniform(0, 5), queued_prefill_s=rng.uniform(0, 10))
        for i in range(args.num_prefill)
    ]
    decodes = [_decode_view(i, args.running_per_decode, rng) for i in range(args.num_decode)]
    requests = [_request(i, chains, args.prompt_blocks, rng) for i in range(args.iterations)]
    predictors = build_cost_model(SimConfig()).predictors
    results: dict[str, Any] = {}
    for scheduler, admission in _PAIRS:
        config = PolicyConfig(scheduler=scheduler, admission=admission, block_size=512)
        policy = SchedulerPolicy(config, predictors)
        results[f"{scheduler}+{admission}"] = _time_decisions(requests, prefills, decodes, index, policy)
    reference = results[f"{_PAIRS[0][0]}+{_PAIRS[0][1]}"]
    print(f"index: {index.num_keys} keys on {len(index.stores())} stores, built in {build_s:.1f} s")
    print(f"{'scheduler+admission':<44}{'p50 ms':>9}{'p99 ms':>9}{'p99 cpu ms':>12}{'p50 ratio':>11}")
    for name, timing in results.items():
        ratio = timing["p50_decision_ms"] / reference["p50_decision_ms"]
        print(f"{name:<44}{timing['p50_decision_ms']:>9.3f}{timing['p99_decision_ms']:>9.3f}"
              f"{timing['p99_decision_cpu_ms']:>12.3f}{ratio:>11.2f}")
    output = {
        "p50_decision_ms": reference["p50_decision_ms"],
        "p99_decision_ms": reference["p99_decision_ms"],
        "p99_decision_cpu_ms": reference["p99_decision_cpu_ms"],
        "target_p99_ms": 1.0,
        "num_keys": index.num_keys,
        "num_prefill": args.num_prefill,
        "num_decode": args.num_decode,
        "prompt_blocks": args.prompt_blocks,
        "by_policy": results,
    }
    if args.json:
        write_json(args.json, output)
    return 0


def _build_index(args: argparse.Namespace, rng: random.Random) -> tuple[ShadowIndex, list[list[int]]]:
    index = ShadowIndex()
    stores = [f"p{i}" for i in range(args.num_prefill)] + [f"d{i}" for i in range(args.num_decode)]
    holdings: dict[str, list[int]] = {store: [] for store in stores}
    chains: list[list[int]] = []
    for start in range(0, args.num_keys, _CHAIN):
        chain = list(range(start, min(start + _CHAIN, args.num_keys)))
        chains.append(chain)
        num_copies = rng.randint(8, len(stores)) if len(chains) % 100 == 1 else rng.randint(1, 3)
        owners = rng.sample(stores, min(num_copies, len(stores)))
        holdings[owners[0]].extend(chain)  # one full copy: every key is in the index
        for store in owners[1:]:
            holdings[store].extend(chain[: rng.randint(1, len(chain))])  # replicas hold prefixes of varied length
    for store, keys in holdings.items():
        index.apply_dump(store, 0, keys)
    return index, chains


def _request(i: int, chains: list[list[int]], num_blocks: int, rng: random.Random) -> RequestInfo:
    chain = chains[rng.randrange(len(chains))]
    shared = chain[: rng.randint(0, min(len(chain), num_blocks))]
    fresh = [-(i * num_blocks + j + 1) for j in range(num_blocks - len(shared))]  # never stored
    return RequestInfo(f"bench-{i}", num_blocks * 512, tuple(shared + fresh))


def _decode_view(i: int, num_running: int, rng: random.Random) -> DecodeInstanceView:
    tokens = tuple(rng.randint(1000, 30000) for _ in range(num_running))
    started = tuple(rng.uniform(0, 20) for _ in range(num_running))
    incoming = tuple((rng.uniform(20, 30), rng.randint(1000, 30000)) for _ in range(4))
    return DecodeInstanceView(f"decode-{i}", f"d{i}", num_running, sum(tokens), 128, 1_500_000,
                              started, tokens, incoming)


def _time_decisions(
    requests: list[RequestInfo],
    prefills: list[PrefillInstanceView],
    decodes: list[DecodeInstanceView],
    index: ShadowIndex,
    policy: SchedulerPolicy,
) -> dict[str, float]:
    """Wall time per decision, and this thread's CPU time (which excludes preemption on a shared machine)."""
    timings: list[float] = []
    cpu_timings: list[float] = []
    for request in requests:
        cpu_started = time.thread_time()
        started = time.perf_counter()
        schedule(request, prefills, decodes, index, policy, now=20.0)
        timings.append((time.perf_counter() - started) * 1000)
        cpu_timings.append((time.thread_time() - cpu_started) * 1000)
    return {
        "p50_decision_ms": _percentile(timings, 0.5),
        "p99_decision_ms": _percentile(timings, 0.99),
        "mean_decision_ms": sum(timings) / len(timings),
        "p50_decision_cpu_ms": _percentile(cpu_timings, 0.5),
        "p99_decision_cpu_ms": _percentile(cpu_timings, 0.99),
    }


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))]
