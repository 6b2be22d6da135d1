"""`mooncaked bench rpc`: unary round trips over loopback, our RPC vs aiohttp HTTP vs a bare msgpack echo.

Stages:
  1. For each system (echo, rpc, http; both ends in rpc_systems.py) start its server in a child process of
     this Python (uvloop) on 127.0.0.1; it prints its port and serves until its stdin closes.
  2. In this process (uvloop), keep `concurrency` calls in flight for warmup_s + seconds, recording the
     latency of every call that finishes after the warm-up.
  3. Stop the server. Stages 1-2 repeat for `rounds` rounds that interleave the systems (in alternating
     order), so that load from other processes on the machine hits them alike; each system reports its
     median round.
  4. Print a table and write JSON: calls/s and p50/p99 latency per system, plus ratio = rpc / http and
     ratio_vs_echo = rpc / echo (targets: >= 3 and >= 0.5; the bare echo is the ceiling).
"""

from __future__ import annotations

import argparse
import asyncio
import select
import statistics
import subprocess
import sys
import time
from typing import Any, Awaitable

from mooncaked.bench.report import write_json
from mooncaked.bench.rpc_systems import CLIENTS

SYSTEMS = ("echo", "rpc", "http")
_SERVER_START_TIMEOUT_S = 30.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON to FILE")
    parser.add_argument("--seconds", type=float, default=3.0, help="measured seconds per system (default 3)")
    parser.add_argument("--warmup-s", type=float, default=0.5, help="unmeasured seconds before each (default 0.5)")
    parser.add_argument("--concurrency", type=int, default=64, help="calls in flight (default 64)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of echo,rpc,http")
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved rounds; each system reports its median round (default 3)")


def run(args: argparse.Namespace) -> int:
    systems = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown or args.seconds <= 0 or args.concurrency < 1 or args.rounds < 1:
        print(f"bench rpc: bad arguments (unknown systems {unknown}; --seconds > 0, --concurrency >= 1, "
              "--rounds >= 1)", file=sys.stderr)
        return 2
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in systems}
    for i in range(args.rounds):
        for name in (systems if i % 2 == 0 else systems[::-1]):
            rounds[name].append(_measure(name, args))
            if args.rounds > 1:
                print(f"round {i + 1}/{args.rounds} {name}: {rounds[name][-1]['calls_per_s']:.0f} calls/s",
                      flush=True)
    results = {name: _median_round(runs) for name, runs in rounds.items()}
    summary = _summarize(results, args)
    _print_table(results, summary)
    if args.json:
        write_json(args.json, summary)
    return 0


def _measure(system: str, args: argparse.Namespace) -> dict[str, float]:
    """Run one system's server in a child process of this Python and load it from this one."""
    code = f"from mooncaked.bench.rpc_systems import serve_main; serve_main({system!r})"
    server = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert server.stdout is not None and server.stdin is not None
    try:
        is_ready, _, _ = select.select([server.stdout], [], [], _SERVER_START_TIMEOUT_S)
        line = server.stdout.readline() if is_ready else b""
        if not line.strip().isdigit():
            raise RuntimeError(f"bench rpc: the {system} server did not report its port within "
                               f"{_SERVER_START_TIMEOUT_S}s (exit code {server.poll()})")
        return _run_uvloop(_load(system, int(line), args))
    finally:
        server.stdin.close()  # the server stops at EOF on its stdin
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _run_uvloop(coro: Awaitable[dict[str, float]]) -> dict[str, float]:
    import uvloop

    async def main() -> dict[str, float]:
        return await coro

    return uvloop.run(main())


async def _load(system: str, port: int, args: argparse.Namespace) -> dict[str, float]:
    call, close = await CLIENTS[system](port, args.concurrency)
    latencies_s: list[float] = []
    loop = asyncio.get_running_loop()
    start = loop.time() + args.warmup_s
    end = start + args.seconds

    async def worker() -> None:
        clock = time.perf_counter
        while loop.time() < end:
            began = clock()
            await call()
            if loop.time() >= start:
                latencies_s.append(clock() - began)

    try:
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    finally:
        await close()
    measured_s = loop.time() - start
    latencies_s.sort()
    return {
        "calls_per_s": len(latencies_s) / measured_s,
        "p50_ms": 1e3 * statistics.median(latencies_s),
        "p99_ms": 1e3 * latencies_s[min(len(latencies_s) - 1, int(0.99 * len(latencies_s)))],
        "num_calls": float(len(latencies_s)),
    }


# --- report -------------------------------------------------------------------------------------


def _summarize(results: dict[str, dict[str, float]], args: argparse.Namespace) -> dict[str, Any]:
    summary: dict[str, Any] = {"concurrency": args.concurrency, "seconds": args.seconds, "rounds": args.rounds,
                               "python": sys.version.split()[0]}
    for name, result in results.items():
        summary[f"{name}_calls_per_s"] = round(result["calls_per_s"], 1)
        summary[f"{name}_p50_ms"] = round(result["p50_ms"], 3)
        summary[f"{name}_p99_ms"] = round(result["p99_ms"], 3)
    if "rpc" in results and "http" in results:
        summary["ratio"] = round(results["rpc"]["calls_per_s"] / results["http"]["calls_per_s"], 2)
    if "rpc" in results and "echo" in results:
        summary["ratio_vs_echo"] = round(results["rpc"]["calls_per_s"] / results["echo"]["calls_per_s"], 2)
    return summary


def _median_round(runs: list[dict[str, float]]) -> dict[str, float]:
    return sorted(runs, key=lambda run: run["calls_per_s"])[len(runs) // 2]


def _print_table(results: dict[str, dict[str, float]], summary: dict[str, Any]) -> None:
    print(f"{'system':<8}{'calls/s':>12}{'p50 ms':>10}{'p99 ms':>10}")
    for name, result in results.items():
        print(f"{name:<8}{result['calls_per_s']:>12.0f}{result['p50_ms']:>10.3f}{result['p99_ms']:>10.3f}")
    for key, target in (("ratio", 3.0), ("ratio_vs_echo", 0.5)):
        if key in summary:
            verdict = "met" if summary[key] >= target else "NOT met"
            print(f"{key} = {summary[key]:.2f} (target >= {target}: {verdict})")
