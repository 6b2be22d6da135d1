"""Fault rounds on a NetworkFleet (network_fleet.py), for `bench network --cluster` and
tests/bench/test_network_fleet_faults.py.

Each round returns the bench's per-fault counts: `requests`, `completed` (whole and right), `failed` (ended with
an error within its deadline), `lost` (ended without an error but wrong or partial), `hung` (no end within its
deadline), `migrated`, `recovery_s` (None where nothing heals), and what the fault itself shows.

1. `nic_down_during_loads`: `num_loads` prompts of NUM_PROMPT_TOKENS, each stored on s1 only (computed by p1, whose
   first token is the reference), loaded one after another by p0 (PREFILL fetching the whole prefix from s1:
   host 1 to host 0 over both NIC pairs). `down_after_s` into the first load, NIC 1 of host 1 goes down for
   `down_s` (None: until the loads end). `migrated`: completed loads in flight while it was down (their slices
   moved to NIC 0); `nic1_failed_seen`: p0's paths over NIC 1 were seen cooling down while NIC 0's were usable.
   Then every prompt is prefilled again on p0 from host 0's store: a load counts as completed only if that
   reuses every block and gives the reference token (a partial or corrupt block committed as complete would
   show as `lost`). `recovery_s`: from the heal to the end of the first load started after it (with `down_s`
   set, one more load runs after the heal when none of the others started after it).
2. `slow_link_placement`: `num_requests` prompts stored on s1 only (host 1, the slow host), p1 stopped, then sent
   through conductor c0 one by one: the first is fetched at the configured rate and so measures the slow link;
   each later one's placement is recorded before it is sent, with Algorithm 1's line-5 plan under the same
   measured rate (`placements`), and `fetched_after_measure` / `computed_after_measure` count the blocks the
   later ones fetched or computed. p1 is started again at the end.
3. `etcd_cut`: the leading conductor's rail-1 link (its only path to etcd) goes down until the other leads, then
   comes back. Both conductors are sampled every 20 ms (`is_leader()`, the P/D controller's `is_leading`);
   `stepped_down_s` / `takeover_s`: from the cut to the old leader's last and the new leader's first leading
   sample; `is_overlap`: two conductors led at once. `num_requests` completions go to each conductor during the
   cut (placement needs no lease). `recovery_s`: from the heal until both views show every member up and the
   old leader follows the new one.
4. `run_fleet_faults(args)`: one fleet, the three rounds in that order (`fleet_requests` loads or requests each;
   the NIC stays down `fault_s`, at most half the lease TTL: host 1 reaches etcd over it too), then the fleet is
   torn down.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mooncaked.bench.etcd_server import MISSING_REASON, etcd_binary
from mooncaked.bench.network_fleet import ETCD_HOST, LEASE_TTL_S, SLOW_HOST, NetworkFleet
from mooncaked.model.loader import load_model
from mooncaked.roles.worker.messages import PrefillRequest, SamplingSpec
from mooncaked.rpc import RpcError
from mooncaked.sched.prefix_plans import prefix_plans
from mooncaked.sched.types import Placement, RequestInfo

logger = logging.getLogger(__name__)

NUM_PROMPT_TOKENS = 968  # 60 whole blocks of 16 and 8 tokens more: every block is a reusable prefix block
NUM_BLOCKS = NUM_PROMPT_TOKENS // 16
LOAD_TIMEOUT_S = 20.0
REQUEST_TIMEOUT_S = 15.0


def fault_prompt(seed: int, num_tokens: int = NUM_PROMPT_TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(num_tokens)]


def prefill_request(fleet: NetworkFleet, request_id: str, tokens: list[int], **fetch: Any) -> PrefillRequest:
    return PrefillRequest(request_id, tokens, fleet.keys(tokens), SamplingSpec(max_tokens=1, temperature=0.0),
                          **fetch)


def store_on_s1(fleet: NetworkFleet, prefix: str, prompts: list[list[int]]) -> list[int]:
    """Prefill each prompt on p1 (host 1): s1 then holds its blocks. Their first tokens (computed whole)."""
    return [fleet.prefill("p1", prefill_request(fleet, f"{prefix}{i}", tokens)).first_token.token_id
            for i, tokens in enumerate(prompts)]


def nic_down_during_loads(fleet: NetworkFleet, num_loads: int = 1, down_after_s: float = 0.3,
                          down_s: float | None = None, seed: int = 2901) -> dict[str, Any]:
    num_spare = 0 if down_s is None else 1  # one more load after the heal, if none of the others started after it
    prompts = [fault_prompt(seed + 100 * i) for i in range(num_loads + num_spare)]
    references = store_on_s1(fleet, "nic-store", prompts)
    engine, endpoint = fleet.inner("p0").worker.engine, fleet.inner("s1").engine.endpoint
    path_samples: list[dict[str, bool]] = []
    is_watching = threading.Event()
    is_watching.set()

    async def watch_paths() -> None:
        while is_watching.is_set():
            path_samples.append(engine.path_states(endpoint))
            await asyncio.sleep(0.02)

    fault: dict[str, float] = {}

    def pull_cable() -> None:
        time.sleep(down_after_s)
        fault["down_at"] = time.monotonic()
        fleet.net.set_link(SLOW_HOST, 1, False)
        if down_s is not None:
            time.sleep(down_s)
            fleet.net.set_link(SLOW_HOST, 1, True)
            fault["up_at"] = time.monotonic()

    watcher = threading.Thread(target=fleet.on, args=("p0", watch_paths, 300.0), name="bench-paths")
    puller = threading.Thread(target=pull_cable, name="bench-cable")
    watcher.start()
    puller.start()
    loads = []
    try:
        for i, tokens in enumerate(prompts[:num_loads]):
            loads.append(_load(fleet, f"nic-load{i}", tokens, references[i]))
        if num_spare:
            puller.join(down_after_s + (down_s or 0.0) + 5.0)
            if not any(load["start"] >= fault.get("up_at", float("inf")) for load in loads):
                loads.append(_load(fleet, f"nic-load{num_loads}", prompts[-1], references[-1]))
    finally:
        puller.join(down_after_s + (down_s or 0.0) + 5.0)
        if "up_at" not in fault:
            fleet.net.set_link(SLOW_HOST, 1, True)
            fault["up_at"] = time.monotonic()
        is_watching.clear()
        watcher.join(5.0)
    for i, (tokens, load) in enumerate(zip(prompts, loads)):
        again = fleet.prefill("p0", prefill_request(fleet, f"nic-again{i}", tokens))
        load["is_whole"] = (again.num_fetched_blocks == 0 and again.num_cached_tokens == NUM_BLOCKS * 16
                            and again.first_token.token_id == references[i])
    down_at, up_at = fault.get("down_at", fault["up_at"]), fault["up_at"]
    done = [load for load in loads if load["error"] is None and load["is_right"] and load["is_whole"]]
    after_heal = [load for load in done if load["start"] >= up_at]
    return {
        "requests": len(loads), "completed": len(done),
        "failed": sum(load["error"] is not None and not load["is_hung"] for load in loads),
        "lost": sum(load["error"] is None and not (load["is_right"] and load["is_whole"]) for load in loads),
        "hung": sum(load["is_hung"] for load in loads),
        "migrated": sum(load["start"] < up_at and load["end"] > down_at for load in done),
        "recovery_s": round(after_heal[0]["end"] - up_at, 2) if after_heal else None,
        "load_s": [round(load["end"] - load["start"], 2) for load in loads],
        "nic1_failed_seen": any(_is_nic1_down(states) for states in path_samples),
        "down_s": round(up_at - down_at, 2),
    }


def _load(fleet: NetworkFleet, request_id: str, tokens: list[int], reference: int) -> dict[str, Any]:
    request = prefill_request(fleet, request_id, tokens, fetch_store="s1", num_fetch_blocks=NUM_BLOCKS)
    start = time.monotonic()
    error, is_hung, is_right = None, False, False
    try:
        reply = fleet.prefill("p0", request, LOAD_TIMEOUT_S)
        is_right = reply.num_fetched_blocks == NUM_BLOCKS and reply.first_token.token_id == reference
    except TimeoutError as exc:
        error, is_hung = str(exc), True
    except RpcError as exc:
        error = str(exc)
    return {"start": start, "end": time.monotonic(), "error": error, "is_hung": is_hung, "is_right": is_right}


def _is_nic1_down(states: dict[str, bool]) -> bool:
    return (any(not ok for path, ok in states.items() if "@nic1>" in path)
            and all(ok for path, ok in states.items() if "@nic0>" in path))


def slow_link_placement(fleet: NetworkFleet, num_requests: int = 2, seed: int = 2902) -> dict[str, Any]:
    prompts = [fault_prompt(seed + 100 * i) for i in range(num_requests)]
    tokenizer = load_model(fleet.inner("p0").worker.config.model.source).tokenizer
    references = [tokenizer.decode([token]) for token in store_on_s1(fleet, "slow-store", prompts)]
    view = fleet.conductor("c0").view
    assert view is not None
    fleet.stop("p1")  # every prompt now goes to p0 on host 0: fetch over the slow link, or recompute
    try:
        fleet.wait("c0", lambda v: "p1" not in v.prefill or not v.prefill["p1"].is_placeable, 10.0, "p1 gone")
        last_keys = fleet.keys(prompts[-1])
        fleet.wait("c0", lambda v: max(v.index.prefix_lengths(last_keys).values(), default=0) == NUM_BLOCKS,
                   5.0, "the index shows s1's blocks")
        migrations_before = fleet.migrations("c0")
        results, placements, before = [], [], {}
        for i, tokens in enumerate(prompts):
            if i == 1:
                before = fleet.read("c0", lambda: dict(view.prefix_blocks))
            if i >= 1:
                info = RequestInfo(f"slow-probe{i}", len(tokens), tuple(fleet.keys(tokens)), max_tokens=1)
                placements.append(fleet.read("c0", lambda: _placement_and_papers(view, info)))
            results.append(_request(fleet, "c0", tokens, 1, references[i]))
        after = fleet.read("c0", lambda: dict(view.prefix_blocks))
        measured = dict(fleet.read("c0", lambda: view.fetch_rates.for_instance("p0"))).get("s1")
        configured = fleet.read("c0", lambda: view.predictors.current.transfer.bandwidth)
        return {**_counts(results), "migrated": int(fleet.migrations("c0") - migrations_before), "recovery_s": None,
                "measured_bytes_per_s": measured, "configured_bytes_per_s": configured, "placements": placements,
                "fetched_after_measure": after["reused_remote"] - before.get("reused_remote", after["reused_remote"]),
                "computed_after_measure": after["computed"] - before.get("computed", after["computed"])}
    finally:
        fleet.start("p1")
        fleet.wait_converged(15.0)


def _placement_and_papers(view: Any, info: RequestInfo) -> dict[str, Any]:
    """Where c0 would place `info` now, and the plan Algorithm 1's line 5 gives p0 under the same rates."""
    placed = view.placer.place(info, time.monotonic(), frozenset())
    policy = view.placer.policy()
    papers = prefix_plans(0, view.index.prefix_lengths(info.block_keys), dict(view.fetch_rates.for_instance("p0")),
                          policy.config.kvcache_balancing_threshold, policy.predictors.transfer)[0]
    placement = {"prefill_instance": placed.prefill_instance, "fetch_from_store": placed.fetch_from_store,
                 "predicted_transfer_s": placed.predicted_transfer_s, "predicted_ttft_s": placed.predicted_ttft_s,
                 } if isinstance(placed, Placement) else {"rejected": placed.reason}
    return {**placement, "papers_source": papers.source, "papers_prefix_blocks": papers.num_prefix_blocks,
            "papers_transfer_s": papers.transfer_s}


def _request(fleet: NetworkFleet, conductor: str, tokens: list[int], max_tokens: int,
             reference: str | None) -> dict[str, Any]:
    start = time.monotonic()
    try:
        status, body = fleet.complete(conductor, tokens, max_tokens, REQUEST_TIMEOUT_S)
    except TimeoutError as exc:
        return {"error": str(exc), "is_hung": True, "text": None, "s": time.monotonic() - start}
    text = body["choices"][0]["text"] if status == 200 else None
    error = None if status == 200 else f"HTTP {status}: {body}"
    return {"error": error, "is_hung": False, "text": text, "is_right": reference is None or text == reference,
            "s": time.monotonic() - start}


def _counts(results: list[dict[str, Any]]) -> dict[str, int]:
    return {"requests": len(results), "completed": sum(r["error"] is None and r["is_right"] for r in results),
            "failed": sum(r["error"] is not None and not r["is_hung"] for r in results),
            "lost": sum(r["error"] is None and not r["is_right"] for r in results),
            "hung": sum(r["is_hung"] for r in results)}


def etcd_cut(fleet: NetworkFleet, num_requests: int = 1, seed: int = 2904) -> dict[str, Any]:
    leader = fleet.read("c0", lambda: fleet.controller("c0").membership.leader())
    if leader not in ("c0", "c1") or fleet.read("c1", lambda: fleet.controller("c1").membership.leader()) != leader:
        raise RuntimeError(f"the conductors do not agree on a leader before the cut (c0 sees {leader})")
    follower = "c1" if leader == "c0" else "c0"
    leader_host = fleet.host_of(leader).host
    assert leader_host != ETCD_HOST
    tokens = fault_prompt(seed, 64)
    reference = _request(fleet, follower, tokens, 2, None)["text"]
    samples: dict[str, list[tuple[float, bool]]] = {leader: [], follower: []}
    is_sampling = threading.Event()
    is_sampling.set()

    def sampler(name: str) -> Callable[[], Any]:
        async def sample() -> None:
            controller = fleet.controller(name)
            while is_sampling.is_set():
                samples[name].append((time.monotonic(), controller.membership.is_leader() or controller.is_leading))
                await asyncio.sleep(0.02)
        return sample

    threads = [threading.Thread(target=fleet.on, args=(name, sampler(name), 120.0), name=f"bench-leads-{name}")
               for name in (leader, follower)]
    for thread in threads:
        thread.start()
    migrations_before = fleet.migrations(leader) + fleet.migrations(follower)
    try:
        cut_at = time.monotonic()
        fleet.net.set_link(leader_host, 1, False)  # its rail-1 link: etcd only
        results = [_request(fleet, name, tokens, 2, reference) for name in (leader, follower)
                   for _ in range(num_requests)]
        fleet.wait(follower, lambda v: fleet.controller(follower).is_leading, LEASE_TTL_S + 5.0, f"{follower} leads")
    finally:
        fleet.net.set_link(leader_host, 1, True)
        healed_at = time.monotonic()
    try:
        fleet.wait(leader, lambda v: fleet.controller(leader).membership.leader() == follower, LEASE_TTL_S + 5.0,
                   f"{leader} back on etcd, following {follower}")
        fleet.wait_converged(LEASE_TTL_S + 5.0)
        recovery_s: float | None = round(time.monotonic() - healed_at, 2)
    except TimeoutError:
        recovery_s = None
    is_sampling.clear()
    for thread in threads:
        thread.join(5.0)
    last_led = max((t for t, is_leading in samples[leader] if is_leading), default=cut_at)
    first_led = min((t for t, is_leading in samples[follower] if is_leading), default=float("inf"))
    return {**_counts(results), "recovery_s": recovery_s,
            "migrated": int(fleet.migrations(leader) + fleet.migrations(follower) - migrations_before),
            "leader": leader, "follower": follower, "stepped_down_s": round(last_led - cut_at, 2),
            "takeover_s": round(first_led - cut_at, 2), "is_overlap": last_led >= first_led,
            "num_samples": min(len(s) for s in samples.values())}


def run_fleet_faults(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """`bench network --cluster`'s rounds on an elastic in-process fleet (network_fleet.py): a NIC down under
    prefix loads, a slow link's placement, etcd cut off from the leading conductor. {} without etcd."""
    if etcd_binary() is None:
        logger.warning("bench network: %s; the fleet's fault rounds are left out", MISSING_REASON)
        return {}
    with tempfile.TemporaryDirectory(prefix="mooncaked-fleet-") as tmp:
        fleet = NetworkFleet(Path(tmp)).up()
        try:
            down_s = min(args.fault_s, LEASE_TTL_S / 2)  # host 1 reaches etcd over that NIC too: less than its TTL
            return {"cluster_nic_down_load": nic_down_during_loads(fleet, args.fleet_requests, 0.3, down_s),
                    "cluster_slow_link": slow_link_placement(fleet, args.fleet_requests),
                    "cluster_etcd_cut": etcd_cut(fleet, args.fleet_requests)}
        finally:
            fleet.down()
