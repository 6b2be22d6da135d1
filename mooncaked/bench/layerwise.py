"""`mooncaked bench layerwise`: what layer-wise KV storing costs a prefill (paper section 3.3.2 / 5.2).

1. Start two stores (this host 127.0.0.1 and a "decode host" 127.0.0.2) and a prefill worker on 127.0.0.1, in
   this process, with the configured model (SmolLM2 by default).
2. For each prompt length and each mode, prefill fresh random prompts (no prefix reuse):
   `none` (compute only), `layerwise` (after layer i, layer i's KV goes to the local store and over TCP to the
   decode host's store while layer i+1 computes), `serialized` (the same bytes sent after the whole forward).
3. Modes are interleaved round by round and the median is kept; the JSON holds `layerwise_overhead`
   (layer-wise / none - 1) and `serialized_overhead` per length, and overall (the longest length).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from mooncaked.bench.cluster import free_port
from mooncaked.config import Config, load_config
from mooncaked.kv.keys import block_keys
from mooncaked.roles.worker.kv_plan import KvPlan, plan_prompt_kv
from mooncaked.roles.worker.messages import Destination, SamplingSpec
from mooncaked.roles.worker.prefill_forward import run_prefill_forward
from mooncaked.roles.store import StoreRole
from mooncaked.roles.worker.worker import Worker

MODES = ("none", "layerwise", "serialized")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="embedded:smollm2", help="model source (default: the embedded SmolLM2)")
    parser.add_argument("--lengths", default="1024,2048", help="prompt lengths in tokens")
    parser.add_argument("--rounds", type=int, default=3, help="prefills per mode and length")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--json", help="write the result here")


def _config(tmp: Path, model: str, max_len: int) -> Config:
    local, remote = "127.0.0.1", "127.0.0.2"
    instances = [
        {"name": "s_local", "role": "store", "host": local, "port": free_port(local), "data_port": free_port(local)},
        {"name": "s_decode", "role": "store", "host": remote, "port": free_port(remote),
         "data_port": free_port(remote)},
        {"name": "p0", "role": "prefill", "host": local, "port": free_port(local)},
    ]
    data = {"cluster": {"id": "bench-layerwise", "instances": instances},
            "model": {"source": model, "max_model_len": max_len + 16},
            "store": {"dram_bytes": 1 << 30, "shm_dir": str(tmp)},
            "worker": {"num_kv_pages": max_len // 64 + 4, "prefill_chunk": max_len, "max_batch_tokens": max_len}}
    path = tmp / "bench.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


async def _plan(worker: Worker, tokens: list[int], mode: str, request_id: str) -> KvPlan:
    keys = block_keys(tokens, worker.block_size, worker.namespace)
    destinations: list[Destination] = []
    if mode != "none":
        remote = await worker.store_client("s_decode")
        reply = await remote.allocate(keys, worker.block_nbytes, 60_000)
        destinations = [Destination(i, h) for i, h in enumerate(reply.handles)]
    plan = await plan_prompt_kv(worker, request_id, tokens, keys, timeout_s=60, decode_store="s_decode",
                                destinations=destinations)
    if mode == "none":
        plan.local_handles = []
    return plan


def _forward(worker: Worker, plan: KvPlan, mode: str) -> None:
    """Compute thread: the prefill, storing per `mode`."""
    if mode == "serialized":
        saved, plan.destinations, plan.local_handles = (plan.destinations, plan.local_handles), {}, []
        run_prefill_forward(worker, [plan], [SamplingSpec(max_tokens=1, temperature=0.0)])
        plan.destinations, plan.local_handles = saved
        assert worker.kv_pages is not None
        for layer in range(worker.kv_pages.num_layers):
            plan.store_layer(layer)
        return
    run_prefill_forward(worker, [plan], [SamplingSpec(max_tokens=1, temperature=0.0)])


async def _one(worker: Worker, length: int, mode: str, rng: random.Random, index: int) -> float:
    assert worker.loaded is not None
    tokens = [rng.randrange(3, worker.loaded.args.vocab_size) for _ in range(length)]
    plan = await _plan(worker, tokens, mode, f"bench-{mode}-{length}-{index}")
    try:
        started = time.perf_counter()
        await worker.compute(_forward, worker, plan, mode)
        await plan.kv.wait_writes(60)
        elapsed = time.perf_counter() - started
    finally:
        await plan.close(commit=False)
        remote_ids = [d.handle.handle_id for d in plan.destinations.get("s_decode", [])]
        if remote_ids:
            await (await worker.store_client("s_decode")).abort(remote_ids)
    return elapsed


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        config = _config(Path(tmp), args.model, max(lengths))
        stores = [StoreRole(config, config.instance_named(n)) for n in ("s_local", "s_decode")]
        for store in stores:
            await store.start()
        worker = Worker(config, config.instance_named("p0"))
        await worker.start()
        try:
            return await _measure(worker, lengths, args.rounds)
        finally:
            await worker.stop()
            for store in stores:
                await store.stop()


async def _measure(worker: Worker, lengths: list[int], rounds: int) -> dict[str, Any]:
    rng = random.Random(0)
    await _one(worker, lengths[0], "layerwise", rng, -1)  # warm-up: connections, allocator, kernels
    result: dict[str, Any] = {"lengths": {}}
    for length in lengths:
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        for index in range(rounds):
            for mode in MODES:
                times[mode].append(await _one(worker, length, mode, rng, index))
        medians = {mode: statistics.median(values) for mode, values in times.items()}
        result["lengths"][str(length)] = {
            **{f"{mode}_s": value for mode, value in medians.items()},
            "layerwise_overhead": medians["layerwise"] / medians["none"] - 1,
            "serialized_overhead": medians["serialized"] / medians["none"] - 1,
            "kv_bytes": -(-length // worker.block_size) * worker.block_nbytes,
        }
    longest = result["lengths"][str(max(lengths))]
    result["layerwise_overhead"] = longest["layerwise_overhead"]
    result["serialized_overhead"] = longest["serialized_overhead"]
    return result


def run(args: argparse.Namespace) -> int:
    result = asyncio.run(_bench(args))
    print(f"{'tokens':>7} {'none ms':>9} {'layerwise ms':>13} {'serialized ms':>14} {'lw ovh':>8} {'ser ovh':>8}")
    for length, row in result["lengths"].items():
        print(f"{length:>7} {row['none_s'] * 1e3:9.1f} {row['layerwise_s'] * 1e3:13.1f} "
              f"{row['serialized_s'] * 1e3:14.1f} {row['layerwise_overhead']:8.3f} {row['serialized_overhead']:8.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0
