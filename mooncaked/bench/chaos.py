"""`mooncaked bench chaos`: kill -9 each role in turn under streaming load; what every request saw, and whether
the cluster came back whole.

1. A `--role all` cluster on loopback (the supervisor restarts a killed child): a conductor, a store,
   `--num-prefill` prefill and two decode instances of `--model` (the tiny random model by default).
2. A steady load of streaming greedy requests (chaos_load.py) runs while the cluster is killed, in turn, at
   `--victims` (default: a decode instance, a prefill instance, the store, the conductor), each at a seeded random
   moment `--min-wait-s`..`--max-wait-s` into the load, and a prefill or decode victim only once its LOAD reply
   shows it holding requests (polled every 10 ms, at most `--busy-timeout-s`; `victim_held` says how many): its
   pid comes from its INFO reply, then SIGKILL.
3. Per kill: the requests in flight at that moment and how each ended (completed, error, hung, lost), how many
   requests the conductor migrated meanwhile, and the seconds until a probe request succeeds again.
4. Then the load pauses and drains, and within `--settle-s` every resource must be back to its baseline: no
   reservation, pending allocation or read lease left on any store or decode instance, every worker's KV pages
   free. What is not is counted in `leaked`.
5. JSON: `kills` (one record each) and totals `requests`, `completed`, `migrated`, `errors`, `hung`, `lost`,
   `max_recovery_s`, `leaked`, plus `failover_completion` (of requests in flight on a killed prefill or decode
   instance, the fraction that completed).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from mooncaked.bench.chaos_load import OUTCOMES, SteadyLoad
from mooncaked.bench.cluster import ClusterProcess, free_port, instance, write_config
from mooncaked.bench.report import report
from mooncaked.config import Config, load_config
from mooncaked.roles.worker.messages import LOAD, LoadRequest
from mooncaked.rpc import INFO, InfoRequest, RpcClient, RpcError
from mooncaked.store import messages as kv_msg

VICTIMS = ("d0", "p0", "s0", "c0")
_BUSY_POLL_S = 0.01


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="random:tiny", help="model source (default: the tiny random model)")
    parser.add_argument("--num-prefill", type=int, default=2, help="prefill instances (2: a prefill leg can move)")
    parser.add_argument("--victims", default=",".join(VICTIMS), help="instances to kill, in order")
    parser.add_argument("--rate", type=float, default=4.0, help="requests per second of the steady load")
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--output-tokens", type=int, default=48)
    parser.add_argument("--min-wait-s", type=float, default=2.0, help="load before a kill, at least")
    parser.add_argument("--max-wait-s", type=float, default=5.0, help="load before a kill, at most")
    parser.add_argument("--request-timeout-s", type=float, default=60.0, help="a request that has not ended by "
                        "then is hung")
    parser.add_argument("--settle-s", type=float, default=40.0, help="resources must be back to baseline by then")
    parser.add_argument("--start-timeout-s", type=float, default=180.0)
    parser.add_argument("--busy-timeout-s", type=float, default=20.0, help="a prefill or decode victim is killed "
                        "only once it holds requests, waiting at most this long")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the result here")


def cluster_config(tmp: Path, args: argparse.Namespace) -> tuple[Path, str]:
    prefills = [instance(f"p{i}", "prefill") for i in range(args.num_prefill)]
    instances = [instance("c0", "conductor", rpc_port=free_port()), instance("s0", "store"), *prefills,
                 instance("d0", "decode"), instance("d1", "decode")]
    sections: dict[str, dict[str, Any]] = {
        "model": {"source": args.model, "max_model_len": 2048},
        "runtime": {"drain_timeout_s": 5.0},
        "rpc": {"connect_timeout_s": 1.0, "call_timeout_s": 5.0},
        "store": {"dram_bytes": 256 << 20, "shm_dir": str(tmp), "max_lease_ms": 15_000},
        "scheduler": {"admission": "none"},
        "conductor": {"prefill_timeout_s": 10.0, "first_token_timeout_s": 10.0, "token_timeout_s": 5.0,
                      "max_migrations": 2},
        "worker": {"num_kv_pages": 512, "inline_prefill_max_tokens": 0, "abort_grace_s": 6.0, "profile_s": 1.0},
    }
    path = write_config(tmp / "chaos.yaml", "chaos", instances, sections)
    return path, f"http://127.0.0.1:{instances[0]['port']}"


class Probe:
    """RPC clients to every instance (owned by the run): pids, loads and store counters."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.clients: dict[str, RpcClient] = {}
        for entry in config.cluster.instances:
            port = entry.rpc_port if entry.role == "conductor" else entry.port
            self.clients[entry.name] = RpcClient(f"tcp://{entry.host}:{port}", role="bench", instance="chaos",
                                                 cluster_id=config.cluster.id, secret=None, connect_timeout_s=1.0)

    async def pid(self, name: str) -> int:
        return int((await self.clients[name].call(INFO, InfoRequest(), timeout_s=5.0)).pid)

    async def leftovers(self) -> dict[str, int]:
        """Resources still held: reservations, pending allocations, read leases, KV pages in use."""
        held: dict[str, int] = {}
        for entry in self.config.cluster.instances:
            try:
                if entry.role == "store":
                    stats = (await self.clients[entry.name].call(kv_msg.STATS, kv_msg.StatsRequest(),
                                                                 timeout_s=2.0)).counters
                    held[f"{entry.name}.pending"] = stats["num_pending"]
                    held[f"{entry.name}.read_leases"] = stats["num_read_leases"]
                elif entry.role in ("prefill", "decode"):
                    load = await self.clients[entry.name].call(LOAD, LoadRequest(), timeout_s=2.0)
                    held[f"{entry.name}.pages_in_use"] = load.num_pages - load.num_free_pages
                    held[f"{entry.name}.waiting"] = load.num_waiting
            except RpcError:
                held[f"{entry.name}.unreachable"] = 1
        return held

    async def wait_busy(self, name: str, timeout_s: float) -> int:
        """Poll worker `name` until it holds requests (running or waiting); how many (0 after `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                load = await self.clients[name].call(LOAD, LoadRequest(), timeout_s=2.0)
            except RpcError:
                load = None
            held = 0 if load is None else load.num_running + load.num_waiting
            if held or time.monotonic() >= deadline:
                return held
            await asyncio.sleep(_BUSY_POLL_S)

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()


async def migrations(session: aiohttp.ClientSession, url: str) -> float:
    """The conductor's migration count (0 when it cannot answer)."""
    try:
        async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=2.0)) as response:
            text = await response.text()
    except (aiohttp.ClientError, TimeoutError):
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("mooncaked_migrations_total{"))


async def recovery_s(session: aiohttp.ClientSession, url: str, killed_at: float, timeout_s: float) -> float:
    """Seconds from the kill until a short request succeeds again (inf past `timeout_s`)."""
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
    while time.monotonic() - killed_at < timeout_s:
        try:
            async with session.post(url + "/v1/completions", json=body,
                                    timeout=aiohttp.ClientTimeout(total=5.0)) as response:
                if response.status == 200:
                    return time.monotonic() - killed_at
        except (aiohttp.ClientError, TimeoutError):
            pass
        await asyncio.sleep(0.25)
    return float("inf")


async def settle(probe: Probe, timeout_s: float) -> dict[str, int]:
    """Wait until nothing is held any more; what is still held at `timeout_s` (empty when all came back)."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = {name: value for name, value in (await probe.leftovers()).items() if value}
        if not held or time.monotonic() >= deadline:
            return held
        await asyncio.sleep(0.5)


async def kill_one(victim: str, args: argparse.Namespace, load: SteadyLoad, probe: Probe,
                   session: aiohttp.ClientSession, url: str, rng: random.Random) -> dict[str, Any]:
    """One round: load, kill -9 `victim`, wait for recovery and for the requests in flight then; drain; settle."""
    load.is_sending = True
    await asyncio.sleep(rng.uniform(args.min_wait_s, args.max_wait_s))
    pid = await probe.pid(victim)
    victim_held = await probe.wait_busy(victim, args.busy_timeout_s) if victim.startswith(("p", "d")) else None
    migrated_before = await migrations(session, url)
    in_flight = load.in_flight()
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    recovered_s = await recovery_s(session, url, killed_at, timeout_s=args.start_timeout_s)
    await load.wait_ended(in_flight, args.request_timeout_s + 5.0)
    migrated = max(await migrations(session, url) - migrated_before, 0.0)
    load.is_sending = False
    await load.wait_ended(load.in_flight(), args.request_timeout_s + 5.0)
    held = await settle(probe, args.settle_s)
    outcomes = [load.outcomes[i] for i in in_flight]
    record: dict[str, Any] = {"victim": victim, "pid": pid, "in_flight": len(in_flight), "victim_held": victim_held,
                              "migrated": int(migrated) if victim != "c0" else 0,
                              "recovery_s": recovered_s, "leaked": held, "num_leaked": len(held)}
    for status in OUTCOMES:
        record[status] = sum(1 for o in outcomes if o.status == status)
    record["errors_seen"] = sorted({o.detail for o in outcomes if o.status == "error"})[:5]
    return record


def totals(kills: list[dict[str, Any]], load: SteadyLoad) -> dict[str, Any]:
    outcomes = load.outcomes
    on_workers = [k for k in kills if k["victim"].startswith(("p", "d"))]
    in_flight_workers = sum(k["in_flight"] for k in on_workers)
    return {
        "requests": len(outcomes),
        "completed": sum(1 for o in outcomes if o.status == "completed"),
        "migrated": sum(k["migrated"] for k in kills),
        "errors": sum(1 for o in outcomes if o.status == "error"),
        "hung": sum(1 for o in outcomes if o.status == "hung"),
        "lost": sum(1 for o in outcomes if o.status == "lost"),
        "max_recovery_s": max((k["recovery_s"] for k in kills), default=0.0),
        "leaked": sum(k["num_leaked"] for k in kills),
        "failover_completion": (sum(k["completed"] for k in on_workers) / in_flight_workers
                                if in_flight_workers else None),
    }


async def _bench(args: argparse.Namespace, victims: list[str]) -> dict[str, Any]:
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="bench-chaos-") as tmp_name:
        tmp = Path(tmp_name)
        config_path, url = cluster_config(tmp, args)
        cluster = ClusterProcess(config_path, url, tmp / "chaos.log")
        await cluster.start(args.start_timeout_s)
        probe = Probe(load_config(config_path))
        load = SteadyLoad(url, rate=args.rate, prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
                          timeout_s=args.request_timeout_s, seed=args.seed)
        try:
            async with aiohttp.ClientSession() as session:
                sender = asyncio.create_task(load.run(session))
                try:
                    kills = [await kill_one(v, args, load, probe, session, url, rng) for v in victims]
                finally:
                    await load.stop()
                    await sender
        finally:
            await probe.close()
            clean = await cluster.stop(timeout_s=60.0)
    return {"model": args.model, "rate": args.rate, "num_prefill": args.num_prefill, "seed": args.seed,
            "kills": kills, **totals(kills, load), "clean_exit": clean == 0}


def format_table(result: dict[str, Any]) -> str:
    lines = [f"chaos: {result['model']}, {result['rate']:g} req/s, {result['num_prefill']} prefill + 2 decode",
             f"{'victim':>7} {'held':>5} {'in flight':>9} {'done':>5} {'migr':>5} {'err':>4} {'hung':>5} {'lost':>5} "
             f"{'recovery s':>10} {'leaked':>6}"]
    for k in result["kills"]:
        held = "-" if k["victim_held"] is None else k["victim_held"]
        lines.append(f"{k['victim']:>7} {held:>5} {k['in_flight']:>9} {k['completed']:>5} {k['migrated']:>5} "
                     f"{k['error']:>4} "
                     f"{k['hung']:>5} {k['lost']:>5} {k['recovery_s']:>10.2f} {k['num_leaked']:>6}")
    completion = result["failover_completion"]
    lines.append(f"total: {result['requests']} requests, {result['completed']} completed, {result['migrated']} "
                 f"migrated, {result['errors']} errors, {result['hung']} hung, {result['lost']} lost; max recovery "
                 f"{result['max_recovery_s']:.2f} s; leaked {result['leaked']}; failover completion "
                 f"{'-' if completion is None else f'{completion:.1%}'}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    victims = [v.strip() for v in args.victims.split(",") if v.strip()]
    known = {"c0", "s0", "d0", "d1", *(f"p{i}" for i in range(max(args.num_prefill, 0)))}
    if not victims or set(victims) - known or args.num_prefill < 1 or args.rate <= 0:
        print(f"bench chaos: --victims must name instances among {sorted(known)}, --num-prefill >= 1, --rate > 0")
        return 2
    if not 0 <= args.min_wait_s <= args.max_wait_s:
        print("bench chaos: need 0 <= --min-wait-s <= --max-wait-s")
        return 2
    result = asyncio.run(_bench(args, victims))
    report(result, format_table(result), args.json)
    return 0
