"""`mooncaked bench store`: put then get of fresh objects through our store and through redis-server, one run.

1. Start redis-server (127.0.0.1, a free port, persistence off) and a store in this process (StoreService, RPC and
   transfer engine on 127.0.0.1).
2. For each object size, path and client count (1 and 8): spawn client processes (store_clients.py); each waits at
   a barrier, puts its share of `--num-objects` fresh keys, waits again, gets them back, checking a tag written
   into every object.
   Paths: `store` (a client on another host: RPC allocate/commit + TCP transfer engine from 127.0.0.2),
   `shm` (a same-host client: RPC + memcpy into the mapped pool) and `redis` (redis-py with hiredis, pipelined).
   Throughput = all clients' bytes / (last client's end - first client's start).
3. Print a table; with `--json FILE` write per size (keys "65536", "1048576") the figures and the ratios, each side
   taking its better of 1 and 8 clients. Stop the clients, redis and the store.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import shutil
import socket
import subprocess
import tempfile
import time
from multiprocessing.connection import Connection
from typing import Any

from mooncaked.bench.cluster import free_port
from mooncaked.bench.report import write_json
from mooncaked.bench.store_clients import PHASE_TIMEOUT_S, ClientSpec, client_main, with_index

SIZES = (64 * 1024, 1024 * 1024)
CLIENT_COUNTS = (1, 8)
PATHS = ("store", "shm", "redis")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--num-objects", type=int, default=2000, help="objects per size and run (default 2000)")
    parser.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="object sizes in bytes")
    parser.add_argument("--clients", default=",".join(str(c) for c in CLIENT_COUNTS), help="client counts")
    parser.add_argument("--batch-bytes", type=int, default=16 << 20, help="bytes per RPC batch / redis pipeline")
    parser.add_argument("--depth", type=int, default=4, help="batches in flight per store client")
    parser.add_argument("--redis-server", default="redis-server", help="redis-server executable")


def run(args: argparse.Namespace) -> int:
    sizes = [int(s) for s in args.sizes.split(",")]
    client_counts = [int(c) for c in args.clients.split(",")]
    if shutil.which(args.redis_server) is None:
        print(f"{args.redis_server} not found: install redis-server (apt-get install redis-server)")
        return 2
    results = asyncio.run(_run_all(args, sizes, client_counts))
    summary = {str(size): _summarise(results[size]) for size in sizes}
    _print_table(results, summary)
    if args.json:
        write_json(args.json, {**summary, "runs": {str(s): results[s] for s in sizes}})
    num_bad = sum(run["num_bad"] for size in sizes for run in results[size].values())
    return 1 if num_bad else 0


async def _run_all(args: argparse.Namespace, sizes: list[int],
                   client_counts: list[int]) -> dict[int, dict[str, dict[str, Any]]]:
    from mooncaked.store.service import StoreService, StoreServiceConfig
    from mooncaked.transfer import TransferEngine
    from mooncaked.rpc import RpcServer

    results: dict[int, dict[str, dict[str, Any]]] = {}
    redis_port, redis_process = _start_redis(args.redis_server)
    run_id = 0
    try:
        for size in sizes:
            engine = TransferEngine(host="127.0.0.1", transports=("local", "tcp"))
            await engine.start()
            pool_dir = tempfile.mkdtemp(prefix="mooncaked-bench-", dir="/dev/shm")
            pool_bytes = int(args.num_objects * size * 1.25) + (16 << 20)
            service = StoreService(StoreServiceConfig(
                pool_path=f"{pool_dir}/pool", dram_bytes=pool_bytes, host="127.0.0.1",
                high_watermark=0.98, low_watermark=0.9), engine)
            await service.start()
            server = RpcServer(role="store", instance="bench", cluster_id="bench", secret=None,
                               max_frame_bytes=64 << 20)
            service.add_methods(server)
            port = await server.start_tcp("127.0.0.1", 0)
            results[size] = {}
            try:
                for path in PATHS:
                    for num_clients in client_counts:
                        run_id += 1
                        spec = ClientSpec(path, 0, run_id, args.num_objects // num_clients, size,
                                          max(1, args.batch_bytes // size), args.depth,
                                          f"tcp://127.0.0.1:{port}", redis_port, f"{pool_dir}/pool")
                        results[size][f"{path}/{num_clients}"] = await _run_clients(spec, num_clients)
                        if path == "redis":
                            _redis_flush(redis_port)
            finally:
                await server.stop(2.0)
                await service.stop()
                await engine.stop()
                shutil.rmtree(pool_dir, ignore_errors=True)
    finally:
        redis_process.terminate()
        redis_process.wait(10)
    return results


async def _run_clients(spec: ClientSpec, num_clients: int) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(num_clients)
    pipes = [context.Pipe(duplex=False) for _ in range(num_clients)]
    processes = [context.Process(target=client_main, args=(with_index(spec, i), barrier, pipes[i][1]),
                                 daemon=True) for i in range(num_clients)]
    for process in processes:
        process.start()
    reports = [await asyncio.to_thread(_receive, reader, PHASE_TIMEOUT_S * 2) for reader, _ in pipes]
    for process in processes:
        await asyncio.to_thread(process.join, 10)
        if process.is_alive():
            process.kill()
    errors = [r["error"] for r in reports if r.get("error")]
    if errors:
        raise RuntimeError(f"{spec.path} clients failed: {errors[0]}")
    total_bytes = spec.num_objects * num_clients * spec.object_bytes
    return {
        "put_gbps": total_bytes / _span(reports, "put") / 1e9,
        "get_gbps": total_bytes / _span(reports, "get") / 1e9,
        "num_bad": sum(r["num_bad"] for r in reports),
        "num_objects": spec.num_objects * num_clients,
    }


def _receive(reader: Connection, timeout_s: float) -> dict[str, Any]:
    if not reader.poll(timeout_s):
        return {"error": f"no report within {timeout_s:.0f}s"}
    report: dict[str, Any] = reader.recv()
    return report


def _span(reports: list[dict[str, Any]], phase: str) -> float:
    return max(r[phase][1] for r in reports) - min(r[phase][0] for r in reports)


def _summarise(runs: dict[str, dict[str, Any]]) -> dict[str, float]:
    def best(path: str, what: str) -> float:
        return max(run[f"{what}_gbps"] for name, run in runs.items() if name.startswith(path + "/"))

    out = {f"{path}_{what}_gbps": best(path, what) for path in PATHS for what in ("get", "put")}
    for what in ("get", "put"):
        out[f"{what}_ratio"] = out[f"store_{what}_gbps"] / out[f"redis_{what}_gbps"]
        out[f"shm_{what}_ratio"] = out[f"shm_{what}_gbps"] / out[f"redis_{what}_gbps"]
    return out


def _print_table(results: dict[int, dict[str, dict[str, Any]]], summary: dict[str, dict[str, float]]) -> None:
    print(f"{'size':>9} {'path':>6} {'clients':>7} {'put GB/s':>9} {'get GB/s':>9} {'bad':>4}")
    for size, runs in results.items():
        for name, result in runs.items():
            path, clients = name.split("/")
            print(f"{size:>9} {path:>6} {clients:>7} {result['put_gbps']:>9.2f} {result['get_gbps']:>9.2f} "
                  f"{result['num_bad']:>4}")
        ratios = summary[str(size)]
        print(f"{size:>9} ratios vs redis: network get {ratios['get_ratio']:.2f} put {ratios['put_ratio']:.2f}; "
              f"shm get {ratios['shm_get_ratio']:.2f} put {ratios['shm_put_ratio']:.2f}")


# ---- redis-server ---------------------------------------------------------------------------------------------
def _start_redis(executable: str) -> tuple[int, subprocess.Popen[bytes]]:
    port = free_port("127.0.0.1")
    process = subprocess.Popen([executable, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return port, process
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"redis-server did not answer on port {port} within 10s")


def _redis_flush(port: int) -> None:
    import redis

    redis.Redis(host="127.0.0.1", port=port).flushall()
