"""`mooncaked bench layerwise`: what layer-wise KV storing and loading cost a prefill (paper 3.3.2, its Fig 7).

1. Start two stores as processes of their own (this host 127.0.0.1 and another host 127.0.0.2) and a prefill
   worker on 127.0.0.1 in this process, with the configured model. Compute and copies do not share a core: the
   worker's compute thread runs on `--compute-cpus` with as many torch threads (runtime.num_threads;
   worker.compute_cpus), while its other threads (event loop, KV copy thread, transfer threads) and the store
   processes run on `--copy-cpus` (worker.copy_cpus; the stores' cluster.instances[].cpus). By default the
   last usable CPU is the copy CPU, the others compute. The interpreter lock's switch interval is the one a
   worker process sets (runtime.gil_switch_interval_ms).
2. Storing, fresh random prompts (no reuse): `none` (compute only), `layerwise` (after layer i its KV goes to
   the local store and over TCP to the other host's store while layer i+1 computes), `serialized` (the same
   bytes copied and sent after the whole forward).
3. Loading, a prompt whose first `--prefix-fraction` of blocks sit in the other host's store (seeded untimed):
   `load_layerwise` (the forward starts at once and waits per layer), `load_serial` (every layer loaded, then
   the forward), `in_pages` (the prefix already in the pages: the forward alone), `no_prefix` (the whole prompt
   computed) and `transfer` (the loading alone).
4. Every mode runs once per round, rounds interleave the modes and the lengths (>= 5 rounds), medians are kept.
   JSON per length and overall (the longest): `layerwise_overhead` = layerwise / none - 1,
   `serialized_overhead`, `load_hidden_fraction` = 1 - (load_layerwise - in_pages) / transfer; per mode the
   spread (max - min over rounds), the compute thread's stall between layers and its median layer time
   (from the worker's layer timeline: on a shared machine these say what the wall times cannot).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mooncaked.bench.cluster import instance, write_config
from mooncaked.bench.layerwise_modes import LOAD_MODES, STORE_MODES, ModeRunner, RunTimes
from mooncaked.bench.report import write_json
from mooncaked.bench.store_processes import store_processes
from mooncaked.config import Config, load_config
from mooncaked.roles.worker.worker import Worker
from mooncaked.runtime.cpu_affinity import check_usable, usable_cpus
from mooncaked.runtime.numa import parse_id_list

MODES = STORE_MODES + LOAD_MODES
MIN_ROUNDS = 5
STORE_START_TIMEOUT_S = 120.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="embedded:smollm2", help="model source (default: the embedded SmolLM2)")
    parser.add_argument("--lengths", default="1024,2048", help="prompt lengths in tokens")
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS, help="interleaved rounds (medians need >= 5)")
    parser.add_argument("--prefix-fraction", type=float, default=0.9, help="share of blocks in the other store")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    parser.add_argument("--dtype", default=None, help="float32 on cpu, bfloat16 on cuda unless given")
    parser.add_argument("--compute-cpus", default=None, help="e.g. 0 or 0-2 (default: all usable but the last)")
    parser.add_argument("--copy-cpus", default=None, help="e.g. 1 (default: the last usable CPU)")
    parser.add_argument("--max-layers-in-flight", type=int, default=4, help="worker.max_layers_in_flight")
    parser.add_argument("--json", help="write the result here")


def cpu_split(args: argparse.Namespace) -> tuple[list[int], list[int]]:
    """(compute CPUs, copy CPUs): given ones, else the last usable CPU copies and the others compute."""
    usable = sorted(usable_cpus())
    compute = sorted(parse_id_list(args.compute_cpus)) if args.compute_cpus else usable[:-1] or usable
    copy = sorted(parse_id_list(args.copy_cpus)) if args.copy_cpus else usable[-1:]
    check_usable(compute + copy, "bench layerwise", "--compute-cpus / --copy-cpus")
    return compute, copy


def _config(tmp: Path, args: argparse.Namespace, compute: list[int], copy: list[int]) -> tuple[Path, Config]:
    max_len = max(int(x) for x in args.lengths.split(","))
    instances = [instance("s_local", "store", "127.0.0.1", cpus=copy), instance("s_decode", "store", "127.0.0.2",
                                                                                 cpus=copy),
                 instance("p0", "prefill", "127.0.0.1")]
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    sections: dict[str, dict[str, Any]] = {
        "model": {"source": args.model, "max_model_len": max_len + 16, "device": args.device, "dtype": dtype},
        "runtime": {"num_threads": len(compute)},
        "store": {"dram_bytes": 1 << 30, "shm_dir": str(tmp)},
        "worker": {"num_kv_pages": max_len // 64 + 8, "prefill_chunk": max_len, "max_batch_tokens": max_len,
                   "max_layers_in_flight": args.max_layers_in_flight, "compute_cpus": compute,
                   "copy_cpus": copy},
        "transfer": {"timeout_s": 300.0},
    }
    path = write_config(tmp / "bench-layerwise.yaml", "bench-layerwise", instances, sections)
    return path, load_config(path)


@contextlib.contextmanager
def _pinned_main_thread(cpus: list[int], config: Config) -> Iterator[None]:
    """This thread (and every thread it starts from now on) on `cpus`; torch's thread count and the interpreter
    lock's switch interval as a worker process sets them (cli.py); all restored."""
    import torch

    affinity, threads, switch_s = os.sched_getaffinity(0), torch.get_num_threads(), sys.getswitchinterval()
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(config.runtime.num_threads)
    sys.setswitchinterval(config.runtime.gil_switch_interval_ms / 1000)
    try:
        yield
    finally:
        sys.setswitchinterval(switch_s)
        torch.set_num_threads(threads)
        os.sched_setaffinity(0, affinity)


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    if args.rounds < 1:
        raise ValueError("--rounds must be >= 1")
    compute, copy = cpu_split(args)
    with tempfile.TemporaryDirectory() as tmp:
        config_path, config = _config(Path(tmp), args, compute, copy)
        worker = Worker(config, config.instance_named("p0"))  # checks its CPUs against this thread's
        async with store_processes(config_path, config, ("s_local", "s_decode"), Path(tmp) / "stores.log",
                                   STORE_START_TIMEOUT_S):
            with _pinned_main_thread(copy, config):  # before any thread of the worker starts
                try:
                    await worker.start()
                    result = await _measure(ModeRunner(worker, args.prefix_fraction), args)
                finally:
                    await worker.stop()
    result["setup"] = {"compute_cpus": compute, "copy_cpus": copy, "num_threads": len(compute),
                       "device": args.device, "rounds": args.rounds, "prefix_fraction": args.prefix_fraction,
                       "max_layers_in_flight": args.max_layers_in_flight, "load_average": os.getloadavg()}
    return result


async def _measure(runner: ModeRunner, args: argparse.Namespace) -> dict[str, Any]:
    lengths = [int(x) for x in args.lengths.split(",")]
    for mode in MODES:  # warm-up: connections, staging buffers, allocator, kernels
        await runner.run(mode, lengths[0])
    times: dict[int, dict[str, list[RunTimes]]] = {n: {mode: [] for mode in MODES} for n in lengths}
    for _ in range(args.rounds):
        for length in lengths:
            for mode in MODES:
                times[length][mode].append(await runner.run(mode, length))
    result: dict[str, Any] = {"lengths": {str(n): _summary(runner, n, times[n]) for n in lengths}}
    longest = result["lengths"][str(max(lengths))]
    for key in ("layerwise_overhead", "serialized_overhead", "load_hidden_fraction"):
        result[key] = longest[key]
    return result


def _summary(runner: ModeRunner, length: int, runs: dict[str, list[RunTimes]]) -> dict[str, Any]:
    times = {mode: [run.wall_s for run in values] for mode, values in runs.items()}
    medians = {mode: statistics.median(values) for mode, values in times.items()}
    return {
        **{f"{mode}_s": value for mode, value in medians.items()},
        **{f"{mode}_spread_s": max(values) - min(values) for mode, values in times.items()},
        **{f"{mode}_stall_s": statistics.median(run.stall_s for run in values) for mode, values in runs.items()},
        **{f"{mode}_layer_s": statistics.median(run.layer_s for run in values) for mode, values in runs.items()},
        "layerwise_overhead": medians["layerwise"] / medians["none"] - 1,
        "serialized_overhead": medians["serialized"] / medians["none"] - 1,
        "load_hidden_fraction": 1 - (medians["load_layerwise"] - medians["in_pages"]) / medians["transfer"],
        "kv_bytes": -(-length // runner.worker.block_size) * runner.worker.block_nbytes,
        "num_prefix_blocks": runner.num_prefix_blocks(length),
    }


def run(args: argparse.Namespace) -> int:
    result = asyncio.run(_bench(args))
    print(f"{'tokens':>7} {'none':>9} {'layerwise':>10} {'serialized':>10} {'lw ovh':>7} {'ser ovh':>7}   "
          f"{'no prefix':>9} {'in pages':>9} {'load lw':>9} {'load ser':>9} {'transfer':>9} {'hidden':>7}  (ms)")
    for length, row in result["lengths"].items():
        ms = {mode: row[f"{mode}_s"] * 1e3 for mode in MODES}
        print(f"{length:>7} {ms['none']:9.1f} {ms['layerwise']:10.1f} {ms['serialized']:10.1f} "
              f"{row['layerwise_overhead']:7.3f} {row['serialized_overhead']:7.3f}   {ms['no_prefix']:9.1f} "
              f"{ms['in_pages']:9.1f} {ms['load_layerwise']:9.1f} {ms['load_serial']:9.1f} {ms['transfer']:9.1f} "
              f"{row['load_hidden_fraction']:7.3f}")
    print(f"{'tokens':>7} " + " ".join(f"{mode:>14}" for mode in MODES) + "   compute stall / median layer (ms)")
    for length, row in result["lengths"].items():
        print(f"{length:>7} " + " ".join(f"{row[f'{m}_stall_s'] * 1e3:6.1f} / {row[f'{m}_layer_s'] * 1e3:5.1f}"
                                         for m in MODES))
    setup = result["setup"]
    print(f"compute CPUs {setup['compute_cpus']} ({setup['num_threads']} torch threads), copy CPUs "
          f"{setup['copy_cpus']}, {setup['rounds']} rounds, load average {setup['load_average'][0]:.2f}")
    if args.json:
        write_json(args.json, result)
    return 0
