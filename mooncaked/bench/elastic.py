"""`mooncaked bench elastic`: an elastic fleet on etcd (issue 12): joins, crashes, a conductor killed, leader
takeover, and the P/D ratio controller against a fixed split under a shifting workload.

1. Start etcd on loopback, then each instance as its own process (`mooncaked --role R --config OWN.yaml`, a
   config naming only that instance plus the etcd endpoints; elastic_fleet.py): a store, three switchable
   workers (two prefill, one decode: the best split for the first, prompt-heavy phase) and two conductors. The
   benchmark follows the membership itself, as a reader of etcd.
2. `join_visible_s`: a fourth worker (decode) registers ready -> every conductor lists it as up and ready (it
   places work on it from then). `crash_removed_s`: kill -9 of that worker -> no conductor lists it.
3. `conductor_kill_errors`: clients send requests round-robin to both conductors, retrying a request that
   could not connect on the other one; the leader conductor is killed -9 mid-run. Requests it held fail (they
   are counted apart); every other failure counts. `leader_takeover_s`: the kill -> the other conductor leads.
4. Goodput: the same workload twice, prompt-heavy -> output-heavy -> prompt-heavy Poisson phases, each on a
   fresh fleet starting from the split above: once with the controller (`pd_controller.enabled`), once
   without. Goodput = requests meeting both SLOs per second; `goodput_ratio` = controller / static. With
   `--background-load N`, N processes spin at nice 19 through both runs (killed when they end).
5. Print the figures with their targets and write the JSON; every process is stopped, etcd last.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp

from mooncaked.bench.elastic_fleet import Fleet
from mooncaked.bench.report import report
from mooncaked.bench.serve import ServeBenchConfig, run_benchmark
from mooncaked.bench.trace import BenchRequest, poisson_arrivals

BUSY_LOOP = "while True:\n    pass\n"
TARGETS = {"join_visible_s": "<= 2 s", "crash_removed_s": "<= lease TTL + 2 s", "conductor_kill_errors": "0",
           "leader_takeover_s": "<= lease TTL + 2 s", "goodput_ratio": ">= 1.3 (>= 1.15 with --background-load)",
           "max_switches_per_phase": "<= 2"}
NUM_PHASES = 3  # prompt-heavy, output-heavy, prompt-heavy: two phase changes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # the defaults load the fleet enough that its split matters: SmolLM2 (the tiny model's steps take
    # milliseconds, and one decode instance is never its bottleneck)
    parser.add_argument("--model", default="embedded:smollm2", help="model source (default: SmolLM2; random:tiny "
                        "for the tiny random model)")
    parser.add_argument("--lease-ttl-s", type=int, default=3)
    parser.add_argument("--phase-s", type=float, default=20.0, help="length of each workload phase")
    parser.add_argument("--prompt-heavy", default="600,2,0.7", help="prompt tokens,output tokens,req/s")
    parser.add_argument("--output-heavy", default="24,64,1.5", help="prompt tokens,output tokens,req/s")
    parser.add_argument("--ttft-slo-ms", type=float, default=5000.0)
    parser.add_argument("--tbt-slo-ms", type=float, default=300.0)
    parser.add_argument("--background-load", type=int, default=0, metavar="N",
                        help="N busy processes at the lowest priority (nice 19) during the goodput runs: noise on "
                        "every step and queue time the controller measures")
    parser.add_argument("--max-batch-size", type=int, default=4, help="decode batch of each worker")
    parser.add_argument("--kill-requests", type=int, default=40, help="requests in the conductor-kill run")
    parser.add_argument("--skip-goodput", action="store_true")
    parser.add_argument("--json", default=None, help="write the results here")


async def cluster_info(session: aiohttp.ClientSession, url: str) -> dict[str, Any] | None:
    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        async with session.get(url + "/v1/cluster", timeout=aiohttp.ClientTimeout(total=1.0)) as response:
            return dict(await response.json())
    return None


async def wait_for(check: Any, timeout_s: float, what: str) -> float:
    started = time.monotonic()
    while not await check():
        if time.monotonic() - started > timeout_s:
            raise RuntimeError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.01)
    return time.monotonic()


def lists_ready(info: dict[str, Any] | None, name: str) -> bool:
    return info is not None and any(i["name"] == name and i["is_up"] and i["state"] == "ready"
                                    for i in info["instances"])


async def membership_figures(fleet: Fleet, session: aiohttp.ClientSession) -> dict[str, float]:
    conductors = [fleet.url("c0"), fleet.url("c1")]

    async def everywhere(name: str, present: bool) -> bool:
        infos = await asyncio.gather(*(cluster_info(session, url) for url in conductors))
        if present:
            return all(lists_ready(info, name) for info in infos)
        return all(info is not None and all(i["name"] != name for i in info["instances"]) for info in infos)

    ready_at = await fleet.spawn("w3", "decode")
    visible_at = await wait_for(lambda: everywhere("w3", True), 30.0, "w3 visible on every conductor")
    killed_at = fleet.kill("w3")
    removed_at = await wait_for(lambda: everywhere("w3", False), 60.0, "w3 removed from every conductor")
    return {"join_visible_s": visible_at - ready_at, "crash_removed_s": removed_at - killed_at}


async def conductor_kill_figures(fleet: Fleet, session: aiohttp.ClientSession,
                                 args: argparse.Namespace) -> dict[str, Any]:
    """Kill the leading conductor -9 under load; see the module docstring, stage 3."""
    leader = await _leader(session, fleet)
    other = "c1" if leader == "c0" else "c0"
    counts = {"ok": 0, "held_by_killed": 0, "errors": 0, "retried": 0}
    errors: list[str] = []
    killed_at: float | None = None

    async def one(index: int) -> None:
        first = ("c0", "c1")[index % 2]
        for attempt, name in enumerate((first, "c1" if first == "c0" else "c0")):
            sent_at = time.monotonic()
            body = {"model": "bench", "prompt": [3 + (index * 7 + i) % 250 for i in range(48)], "max_tokens": 16,
                    "temperature": 0.0, "ignore_eos": True}
            try:
                async with session.post(fleet.url(name) + "/v1/completions", json=body,
                                        timeout=aiohttp.ClientTimeout(total=60)) as response:
                    text = await response.text()
                    if response.status == 200:
                        counts["ok"] += 1
                        return
                    errors.append(f"{name}: {response.status} {text[:120]}")
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                if name == leader and killed_at is not None and sent_at <= killed_at:
                    counts["held_by_killed"] += 1  # it held this one when it died
                    return
                if name == leader and killed_at is not None and isinstance(exc, aiohttp.ClientOSError):
                    counts["retried"] += int(attempt == 0)
                    continue  # refused or reset by the dead conductor: the client tries the other one
                errors.append(f"{name}: {type(exc).__name__} {exc}")
            counts["errors"] += 1
            return
        counts["errors"] += 1

    tasks = []
    for index in range(args.kill_requests):
        tasks.append(asyncio.create_task(one(index)))
        if index == args.kill_requests // 2:
            killed_at = fleet.kill(leader)
        await asyncio.sleep(0.1)
    took_over_at = await wait_for(lambda: _is_leader(session, fleet, other), 60.0, f"{other} leads")
    await asyncio.gather(*tasks)
    assert killed_at is not None
    return {"conductor_kill_errors": counts["errors"], "conductor_kill_held": counts["held_by_killed"],
            "conductor_kill_ok": counts["ok"], "conductor_kill_retried": counts["retried"],
            "conductor_kill_error_samples": errors[:5], "leader_takeover_s": took_over_at - killed_at,
            "killed_conductor": leader}


async def _leader(session: aiohttp.ClientSession, fleet: Fleet) -> str:
    for _ in range(500):
        info = await cluster_info(session, fleet.url("c0"))
        leader = (info or {}).get("controller", {}).get("leader")
        if leader in ("c0", "c1"):
            return str(leader)
        await asyncio.sleep(0.02)
    raise RuntimeError("no conductor leads")


async def _is_leader(session: aiohttp.ClientSession, fleet: Fleet, name: str) -> bool:
    info = await cluster_info(session, fleet.url(name))
    return bool(info and info.get("controller", {}).get("is_leader"))


def phase_requests(args: argparse.Namespace, seed: int) -> list[BenchRequest]:
    requests: list[BenchRequest] = []
    for phase, spec in enumerate((args.prompt_heavy, args.output_heavy, args.prompt_heavy)):
        num_prompt, num_output, rate = (float(x) for x in spec.split(","))
        arrivals = poisson_arrivals(max(int(rate * args.phase_s), 1), rate, seed + phase)
        for arrival in arrivals:
            index = len(requests)
            tokens = tuple(3 + (index * 131 + i * 7) % 250 for i in range(int(num_prompt)))
            requests.append(BenchRequest(index, phase * args.phase_s + arrival, tokens, int(num_output)))
    return requests


async def goodput_run(root: Path, args: argparse.Namespace, is_controller_on: bool) -> dict[str, Any]:
    fleet = Fleet(root, args, is_controller_on)
    try:
        await fleet.start_fleet()
        requests = tuple(phase_requests(args, seed=7))
        duration_s = 3 * args.phase_s + 30.0
        config = ServeBenchConfig(url=fleet.url("c0"), endpoint="completions", model="bench", api_key=None,
                                  requests=requests, max_concurrency=None, timeout_s=duration_s,
                                  duration_s=duration_s, slos_ms={"ttft": args.ttft_slo_ms, "tbt": args.tbt_slo_ms},
                                  show_progress=False)
        started_at = time.time()  # the switch records' clock
        result = await run_benchmark(config)
        async with aiohttp.ClientSession() as session:
            info = await cluster_info(session, fleet.url("c0")) or {}
            info_other = await cluster_info(session, fleet.url("c1")) or {}
        controllers = [i.get("controller", {}) for i in (info, info_other)]
        switches = [s for c in controllers for s in c.get("switches", [])]
        return {"switches_per_phase": switches_per_phase(switches, started_at, args.phase_s),
                "goodput": result["request_goodput"], "completed": result["completed"],
                "failed": result.get("failed", 0), "rejected": result.get("rejected", 0),
                "refusals": sorted({e for e in result["errors"] if e})[:5], "p90_ttft_ms": result["p90_ttft_ms"],
                "p90_tbt_ms": result.get("p90_tbt_ms"), "duration_s": result["duration"],
                "role_switches": sum(int(c.get("num_switches", 0)) for c in controllers),
                "switches": switches}
    finally:
        await fleet.stop()


def switches_per_phase(switches: list[dict[str, Any]], started_at: float, phase_s: float) -> list[int]:
    """Role switches made in each phase of a run (a switch after the last phase counts in it): a controller that
    follows the workload switches in the phase a change begins, and not again until the next one."""
    counts = [0] * NUM_PHASES
    for switch in switches:
        if switch.get("is_switched"):
            counts[min(max(int((float(switch["at"]) - started_at) // phase_s), 0), NUM_PHASES - 1)] += 1
    return counts


def _lowest_priority() -> None:
    """nice 19, for the process and for its session's autogroup: with CONFIG_SCHED_AUTOGROUP (on in most
    distributions' kernels) the scheduler shares the CPU between sessions first and a process's nice counts only
    within its own session, so a busy loop in a session of its own would take a full share whatever its nice."""
    os.nice(19)
    with contextlib.suppress(OSError):
        with open("/proc/self/autogroup", "w") as autogroup:
            autogroup.write("19")


@contextlib.contextmanager
def background_load(num_processes: int) -> Iterator[None]:
    """`num_processes` processes spinning at nice 19 while the block runs; every one is killed on the way out."""
    processes = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP], start_new_session=True,
                                  preexec_fn=_lowest_priority,  # before the loop runs: never at full priority
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for _ in range(num_processes)]
    try:
        yield
    finally:
        for process in processes:
            process.kill()
        for process in processes:
            process.wait(timeout=10)


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {"lease_ttl_s": args.lease_ttl_s, "model": args.model, "targets": TARGETS,
                              "load_average": os.getloadavg(), "background_load": args.background_load}
    with tempfile.TemporaryDirectory(prefix="mooncaked-elastic-") as tmp:
        fleet = Fleet(Path(tmp) / "membership", args, is_controller_on=True)
        (Path(tmp) / "membership").mkdir()
        try:
            await fleet.start_fleet()
            async with aiohttp.ClientSession() as session:
                result.update(await membership_figures(fleet, session))
                result.update(await conductor_kill_figures(fleet, session, args))
        finally:
            await fleet.stop()
        if not args.skip_goodput:
            with background_load(args.background_load):
                for name, is_on in (("controller", True), ("static", False)):
                    (Path(tmp) / name).mkdir()
                    run = await goodput_run(Path(tmp) / name, args, is_on)
                    result[f"goodput_{name}"] = run["goodput"]
                    result[f"run_{name}"] = run
            result["role_switches"] = result["run_controller"]["role_switches"]
            result["max_switches_per_phase"] = max(result["run_controller"]["switches_per_phase"])
            result["goodput_ratio"] = result["goodput_controller"] / max(result["goodput_static"], 1e-9)
    result["load_average_after"] = os.getloadavg()
    return result


def format_table(result: dict[str, Any]) -> str:
    ttl = result["lease_ttl_s"]
    rows = [("join_visible_s", result.get("join_visible_s"), 2.0, "<="),
            ("crash_removed_s", result.get("crash_removed_s"), ttl + 2.0, "<="),
            ("conductor_kill_errors", result.get("conductor_kill_errors"), 0, "<="),
            ("leader_takeover_s", result.get("leader_takeover_s"), ttl + 2.0, "<="),
            ("role_switches", result.get("role_switches"), None, ""),
            ("max_switches_per_phase", result.get("max_switches_per_phase"), 2, "<="),
            ("goodput_controller", result.get("goodput_controller"), None, ""),
            ("goodput_static", result.get("goodput_static"), None, ""),
            ("goodput_ratio", result.get("goodput_ratio"), 1.15 if result["background_load"] else 1.3, ">=")]
    lines = [f"{'key':<24}{'value':>12}  target"]
    for key, value, target, op in rows:
        shown = "-" if value is None else (f"{value:.3f}" if isinstance(value, float) else str(value))
        verdict = ""
        if target is not None and value is not None:
            is_met = value <= target if op == "<=" else value >= target
            verdict = f"{op} {target:g} {'ok' if is_met else 'MISSED'}"
        lines.append(f"{key:<24}{shown:>12}  {verdict}")
    lines.append(f"lease_ttl_s = {ttl}; background load {result['background_load']} process(es); load average "
                 f"{result['load_average']} -> {result['load_average_after']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    result = asyncio.run(_bench(args))
    report(result, format_table(result), args.json)
    return 0
