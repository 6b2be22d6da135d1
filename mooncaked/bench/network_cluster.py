"""A whole cluster in a test network, and a decode instance cut off under its streams (`bench network --cluster`).

1. Three hosts of 2 NICs each (testnet.py): host 0 runs the conductor, a store and a prefill instance; hosts 1 and
   2 each a store and a decode instance. Every role is its own process (`mooncaked --role R --instance I`) inside
   its host; each host's NICs are in `transfer.nics`, so KV moves over both NICs of each pair of hosts. The tiny
   random model, 512 KV pages per decode instance (one holds every stream of a run); the conductor's no-token
   deadline is the default 30 s, its LOAD polls time out after 1 s.
2. A load client inside host 0 (network_load.py) waits until the conductor sees every member up, streams
   `streams` concurrent greedy completions of one prompt undisturbed (the reference text, and
   `undisturbed_stream_s`, their median time), then per fault as many again; once each has 3 chunks, the decode
   instance running most of them is cut off for `partition_s`, then restored: `cluster_partition`, its host
   partitioned (every NIC's switch port down); `cluster_sigstop`, its process SIGSTOPped, then SIGCONTed (a gray
   failure: sockets open, nothing answers).
3. Result: `requests`, `completed` (the full text, equal to the reference: migrated streams included), `lost`
   (ended without an error but with other text), `failed` (ended with an error), `hung` (no end within
   `stream_timeout_s`), `migrated` (the round's increase of the conductor's mooncaked_migrations_total),
   `recovery_s` (from the heal until the conductor's view shows every member up again), and the stream times.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from mooncaked.bench import testnet
from mooncaked.bench.network_driver import PeerProcess
from mooncaked.bench.network_load import NUM_PROMPT_TOKENS

CONDUCTOR_PORT = 8000
# (name, role, host index, port); a store's data port is its port + 1
INSTANCES = (("s0", "store", 0, 7100), ("p0", "prefill", 0, 7200), ("s1", "store", 1, 7100),
             ("d1", "decode", 1, 7300), ("s2", "store", 2, 7100), ("d2", "decode", 2, 7300),
             ("c0", "conductor", 0, CONDUCTOR_PORT))


def cluster_config(net: testnet.TestNet, directory: Path) -> Path:
    instances = []
    for name, role, host, port in INSTANCES:
        entry: dict[str, Any] = {"name": name, "role": role, "host": net.nic_address(host, 0), "port": port}
        if role == "store":
            entry["data_port"] = port + 1
        instances.append(entry)
    nics = {net.nic_address(host, 0): [{"name": f"nic{k}", "address": f"{net.nic_address(host, k)}/24"}
                                       for k in range(net.num_nics)] for host in range(net.num_hosts)}
    data = {
        "cluster": {"id": "testnet", "instances": instances},
        "model": {"source": "random:tiny", "name": "tiny", "max_model_len": 1024},
        "kv": {"block_size": 16},
        "runtime": {"drain_timeout_s": 2.0},
        "rpc": {"connect_timeout_s": 1.0},
        "store": {"dram_bytes": 32 << 20, "shm_dir": str(directory)},
        "worker": {"num_kv_pages": 512, "inline_prefill_max_tokens": 0, "prefill_chunk": 64,
                   "max_batch_tokens": 256},
        "conductor": {"load_poll_interval_s": 0.2, "load_poll_timeout_s": 1.0},
        "transfer": {"nics": nics, "io_timeout_s": 2.0, "path_cooldown_s": 1.0, "timeout_s": 10.0},
    }
    path = directory / "cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run_faults(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """One cluster, an undisturbed round of streams, then a round under each fault: `cluster_partition` (the
    busiest decode instance's host cut off) and `cluster_sigstop` (its process stopped: sockets open, nothing
    answers), each for `partition_s`."""
    with tempfile.TemporaryDirectory(prefix="mooncaked-testnet-") as tmp, \
            testnet.TestNet(3, 2, args.rate_mbit) as net:
        directory = Path(tmp)
        config = cluster_config(net, directory)
        processes = {}
        for name, role, host, _ in INSTANCES:
            with open(directory / f"{name}.log", "wb") as log:
                processes[name] = net.exec(host, [sys.executable, "-m", "mooncaked", "--role", role, "--config",
                                                  str(config), "--instance", name], stdout=log, stderr=log)
        load = PeerProcess(net, 0, ["--url", f"http://{net.nic_address(0, 0)}:{CONDUCTOR_PORT}"],
                           module="mooncaked.bench.network_load")
        load.send(f"ready {args.start_timeout_s}")
        if not load.read()["ready"]:
            raise RuntimeError(f"the cluster did not come up within {args.start_timeout_s:g}s: {_log_tails(directory)}")
        undisturbed, _ = _stream(load, args.streams, args)
        if len({r["text"] for r in undisturbed}) != 1 or any(r["error"] for r in undisturbed):
            raise RuntimeError(f"the undisturbed streams differ or failed: {[r['error'] for r in undisturbed]}")
        undisturbed_s = round(statistics.median(r["end"] - r["start"] for r in undisturbed), 2)

        def partition(victim: str) -> Callable[[], None]:
            host = next(h for name, _, h, _ in INSTANCES if name == victim)
            net.partition(host)
            return lambda: net.heal(host)

        def stop(victim: str) -> Callable[[], None]:
            pid = processes[victim].pid
            os.kill(pid, signal.SIGSTOP)
            return lambda: os.kill(pid, signal.SIGCONT)

        faults = {}
        for fault, inject in (("cluster_partition", partition), ("cluster_sigstop", stop)):
            faults[fault] = {"undisturbed_stream_s": undisturbed_s,
                             **_fault_round(load, inject, undisturbed[0]["text"], args)}
    return faults


def _fault_round(load: PeerProcess, inject: Callable[[str], Callable[[], None]], reference: str,
                 args: argparse.Namespace) -> dict[str, Any]:
    """Streams; once each has its first chunks, `inject` the fault into the decode instance running most of them
    for `partition_s`, then undo it."""
    migrations_before = _migrations(load)
    load.send(f"stream {args.streams} {args.max_tokens} {args.stream_timeout_s}")
    running = load.read()["running"]  # every stream has its first chunks
    victim = max(running, key=lambda name: (running[name], name))
    undo = inject(victim)
    time.sleep(args.partition_s)  # the fault's length
    undo()
    healed_at = time.monotonic()
    results = [load.read() for _ in range(args.streams)]
    fleet = load.read()
    return {"victim": victim, "running_at_fault": running,
            **summarize(results, reference, fleet, healed_at, _migrations(load) - migrations_before, args)}


def _migrations(load: PeerProcess) -> float:
    load.send("metric mooncaked_migrations_total")
    return sum(float(line.rsplit(" ", 1)[1]) for line in load.read()["lines"] if "{" in line)


def _stream(load: PeerProcess, count: int, args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    load.send(f"stream {count} {args.max_tokens} {args.stream_timeout_s}")
    load.read()
    results = [load.read() for _ in range(count)]
    return results, load.read()


def summarize(results: list[dict[str, Any]], reference: str, fleet: dict[str, Any], healed_at: float,
              migrations: float, args: argparse.Namespace) -> dict[str, Any]:
    ended = [r for r in results if r["error"] is None]
    times = sorted(r["end"] - r["start"] for r in ended)
    up_again_at = fleet.get("up_again_at")
    return {
        "requests": len(results),
        "completed": sum(r["text"] == reference and r["num_tokens"] == args.max_tokens for r in ended),
        "lost": sum(r["text"] != reference or r["num_tokens"] != args.max_tokens for r in ended),
        "failed": sum(r["error"] is not None and not r["is_hung"] for r in results),
        "hung": sum(r["is_hung"] for r in results),
        "migrated": int(migrations),
        "recovery_s": round(up_again_at - healed_at, 2) if up_again_at is not None else None,
        "stream_s": [round(t, 2) for t in times],
        "slowest_over_median": round(times[-1] / statistics.median(times), 2) if times else None,
        "errors": sorted({r["error"] for r in results if r["error"] is not None}),
        "prompt_tokens": NUM_PROMPT_TOKENS,
    }


def _log_tails(directory: Path) -> str:
    logs = sorted(directory.glob("*.log"))
    return "; ".join(f"{log.stem}: {log.read_text(errors='replace')[-300:]!r}" for log in logs)
