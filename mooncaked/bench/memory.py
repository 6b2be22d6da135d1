"""`mooncaked bench memory`: what the default cluster holds resident once it has served its first requests.

1. Load `--config` (config.example.yaml) with `--set` overrides; move every instance to free loopback ports
   under a fresh cluster id (a running `make run` is left alone) and write the YAML to a temporary directory.
2. Start `python -m mooncaked --role all` on it (bench.cluster), wait for GET /health, then send `--requests`
   chat completions one at a time (greedy, `--max-tokens` each), every other one a document of about
   `--doc-tokens` tokens to summarize (past `inline_prefill_max_tokens`: the prefill instance computes it and its
   KV travels through the store's pool to the decode instance).
3. Read every process's memory from /proc (bench.proc_memory): RSS with its anonymous, file and shared parts,
   PSS, and what of it is the store's pool (a worker maps the pages it touched) and weight files; SIGTERM the tree.
4. `--runs` times; print per instance the median RSS and PSS (and their spread over runs), the totals (RSS summed,
   which counts a shared page once per process that maps it, and PSS summed: the cluster's own memory) beside the
   model's fp32 weight bytes and the targets (each worker <= 1.5 GB resident, the cluster <= 4 GB); write JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from mooncaked.bench.cluster import ClusterProcess, free_port
from mooncaked.bench.proc_memory import command_line, process_tree, read_memory
from mooncaked.bench.report import write_json
from mooncaked.config import ConfigError, apply_override, load_config
from mooncaked.config.schema import ConfigIssue
from mooncaked.model.loader import model_args
from mooncaked.model.weight_names import num_parameters
from mooncaked.store.shm_pool import pool_path

GB = 1_000_000_000
WORKER_RSS_TARGET = 1.5 * GB
CLUSTER_TARGET = 4 * GB
QUESTIONS = ("What is the capital of France?", "Write a short poem about the sea.",
             "List three uses of a paperclip.", "Explain what a hash function is in two sentences.")
PORT_KEYS = ("port", "rpc_port", "data_port", "metrics_port")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="config.example.yaml", help="the cluster YAML (default: the example)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE")
    parser.add_argument("--requests", type=int, default=4, help="chat completions sent before measuring")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--doc-tokens", type=int, default=600, help="about this many prompt tokens in every other "
                        "request (0: chats only)")
    parser.add_argument("--runs", type=int, default=1, help="clusters started and measured, one after another")
    parser.add_argument("--start-timeout-s", type=float, default=300.0, help="deadline for GET /health")
    parser.add_argument("--json", type=Path, default=None, help="write the result here")


def bench_config(source: Path, overrides: list[str], tmp: Path) -> Path:
    """`source` with `overrides`, on free ports under a fresh cluster id, written into `tmp`."""
    issues: list[ConfigIssue] = []
    data = yaml.safe_load(source.read_text()) or {}
    for override in overrides:
        data = apply_override(data, override, issues)
    if issues:
        raise ConfigError(issues)
    data.setdefault("cluster", {})["id"] = f"bench-memory-{uuid.uuid4().hex[:8]}"
    for entry in data["cluster"].get("instances", []):
        for key in PORT_KEYS:
            if entry.get(key):
                entry[key] = free_port(entry.get("host", "127.0.0.1"))
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def request_text(index: int, doc_tokens: int) -> str:
    """A chat question, or (odd indices, with doc_tokens) a document of about doc_tokens tokens to summarize."""
    if index % 2 == 0 or doc_tokens <= 0:
        return QUESTIONS[(index // 2) % len(QUESTIONS)]
    sentences = [f"Sentence {i}: {QUESTIONS[i % len(QUESTIONS)]}" for i in range(doc_tokens // 14 + 1)]
    return "Summarize this text in one line.\n" + " ".join(sentences)


async def _send_requests(url: str, model: str, num_requests: int, max_tokens: int, doc_tokens: int) -> list[int]:
    """Completion tokens of each request, sent one at a time."""
    tokens = []
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for index in range(num_requests):
            body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0,
                    "messages": [{"role": "user", "content": request_text(index, doc_tokens)}]}
            async with session.post(url + "/v1/chat/completions", json=body) as response:
                answer = await response.json()
                if response.status != 200:
                    raise RuntimeError(f"request {index} failed with {response.status}: {answer}")
                tokens.append(int(answer["usage"]["completion_tokens"]))
    return tokens


def measure_tree(pid: int, pool_file: str) -> list[dict[str, Any]]:
    """Every process of the `--role all` tree rooted at `pid`: its instance, role and memory."""
    kinds: dict[str, Callable[[str], bool]] = {"pool": lambda path: path == pool_file,
                                               "weights": lambda path: path.endswith(".weights")}
    rows = []
    for child in process_tree(pid):
        try:
            argv, memory = command_line(child), read_memory(child, kinds)
        except OSError:
            continue
        role = argv[argv.index("--role") + 1] if "--role" in argv else "?"
        name = argv[argv.index("--instance") + 1] if "--instance" in argv else ("supervisor" if role == "all" else "?")
        rows.append({"instance": name, "role": "supervisor" if role == "all" else role, "pid": child,
                     "rss": memory.rss, "rss_anon": memory.rss_anon, "rss_file": memory.rss_file,
                     "rss_shmem": memory.rss_shmem, "pss": memory.pss,
                     "pool_rss": memory.mapped["pool"].rss, "weights_rss": memory.mapped["weights"].rss,
                     "weights_pss": memory.mapped["weights"].pss})
    return rows


async def measure_once(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    path = bench_config(Path(args.config), args.overrides, tmp)
    config = load_config(path)  # every error of the resulting file, named
    conductor = config.instances_of("conductor")[0]
    url = f"http://{conductor.host}:{conductor.port}"
    pool_file = pool_path(config.cluster.id, config.instances_of("store")[0].name, config.store.shm_dir)
    cluster = ClusterProcess(path, url, tmp / "cluster.log")
    started = time.monotonic()
    await cluster.start(args.start_timeout_s)
    try:
        start_s = time.monotonic() - started
        tokens = await _send_requests(url, config.model.name, args.requests, args.max_tokens, args.doc_tokens)
        assert cluster.process is not None
        rows = measure_tree(cluster.process.pid, pool_file)
    finally:
        await cluster.stop(timeout_s=30.0)
    return {"start_s": start_s, "completion_tokens": tokens, "processes": rows}


def summarize(runs: list[dict[str, Any]], weight_bytes: int) -> dict[str, Any]:
    """Per instance the median (and min/max over runs) of each figure; totals; the targets."""
    names = [row["instance"] for row in runs[0]["processes"]]
    instances = {}
    for name in names:
        rows = [next(r for r in run["processes"] if r["instance"] == name) for run in runs]
        figures = {key: _spread([r[key] for r in rows]) for key in rows[0] if key not in ("instance", "role", "pid")}
        instances[name] = {"role": rows[0]["role"], **figures}
    totals = {key: _spread([sum(r[key] for r in run["processes"]) for run in runs]) for key in ("rss", "pss")}
    worker_rss = [v["rss"]["median"] for v in instances.values() if v["role"] in ("prefill", "decode")]
    return {"weight_bytes_fp32": weight_bytes, "instances": instances, "total": totals,
            "targets": {"worker_rss_max": WORKER_RSS_TARGET, "cluster_max": CLUSTER_TARGET},
            "is_worker_within_target": bool(worker_rss) and max(worker_rss) <= WORKER_RSS_TARGET,
            "is_cluster_within_target": totals["pss"]["median"] <= CLUSTER_TARGET}


def _spread(values: list[int]) -> dict[str, float]:
    return {"median": float(statistics.median(values)), "min": float(min(values)), "max": float(max(values))}


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> int:
    runs = []
    for index in range(args.runs):
        print(f"run {index + 1}/{args.runs}: starting the cluster ...", flush=True)
        with tempfile.TemporaryDirectory(prefix="mooncaked-bench-memory-") as tmp:
            runs.append(await measure_once(args, Path(tmp)))
    source = load_config(args.config, args.overrides).model.source
    result = {"config": args.config, "overrides": args.overrides, "model": source, "runs": runs,
              "load_average": os.getloadavg(), **summarize(runs, num_parameters(model_args(source)) * 4)}
    _print_table(result)
    if args.json is not None:
        write_json(args.json, result)
    return 0


def _print_table(result: dict[str, Any]) -> None:
    print(f"\nresident memory after the first requests ({len(result['runs'])} runs: median [min-max]), GB = 1e9 bytes")
    print(f"{'instance':<12} {'role':<10} {'RSS':>18} {'PSS':>18} {'of RSS: pool':>13} {'weight files':>13}")
    for name, row in result["instances"].items():
        print(f"{name:<12} {row['role']:<10} {_g(row['rss']):>18} {_g(row['pss']):>18} "
              f"{row['pool_rss']['median'] / GB:>13.2f} {row['weights_rss']['median'] / GB:>13.2f}")
    total = result["total"]
    print(f"{'total':<23} {_g(total['rss']):>18} {_g(total['pss']):>18}   (RSS counts shared pages in every process "
          "that maps them; PSS once)")
    print(f"model weights, fp32: {result['weight_bytes_fp32'] / GB:.2f} GB; targets: each worker RSS <= "
          f"{WORKER_RSS_TARGET / GB:.1f} GB ({'met' if result['is_worker_within_target'] else 'MISSED'}), the cluster "
          f"<= {CLUSTER_TARGET / GB:.0f} GB ({'met' if result['is_cluster_within_target'] else 'MISSED'}); "
          f"load average {' '.join(f'{x:.1f}' for x in result['load_average'])}")


def _g(spread: dict[str, float]) -> str:
    return f"{spread['median'] / GB:.2f} [{spread['min'] / GB:.2f}-{spread['max'] / GB:.2f}]"
