"""`mooncaked bench network`: TCP transfers between two hosts of a test network (testnet.py), 2 NICs each.

Stages (every transfer is a READ of seeded bytes, checked by sha256 at the client, network_peer.py):
  1. multi_nic: after one unmeasured transfer per client (NIC discovery, connections), `repeats` rounds of one
     `mib` transfer over 1 NIC (a client configured with NIC 0 only) and one
     over 2 NICs; `multi_nic_ratio` is the median 2-NIC rate over the median 1-NIC rate. What binds: each
     process's CPU share over the 2-NIC transfers (CPU seconds / wall seconds; near 1 would be CPU-bound) and
     the goodput over the links' rate (near 1: link-bound).
  2. Faults, each a run of back-to-back `fault_mib` transfers: `lead_s` healthy, the fault for `fault_s`, then
     healed for `tail_s`. nic_down: the switch port of the server's NIC 1 goes down (a pulled cable) and back
     up; partition: every port of the server's host does. Per fault: `requests` (transfers), `completed`
     (intact), `failed` (ended with an error, within their deadline), `lost` (reported done with wrong bytes),
     `hung` (ran past their deadline `transfer_timeout_s` plus a second), `migrated` (completed intact while
     the fault was on: their slices moved to the surviving NIC), `completed_after_heal` (intact transfers
     started after the heal), `recovery_s` (from the heal to the end of the first transfer at >= 80% of the
     median healthy transfer's rate), the mean rate before, during (from one bucket after the fault),
     `failed_over` (from 2 x io_timeout_s, when the failure has surely been noticed, to the heal) and after the
     fault (from `cooldown_s` plus a bucket after the heal), and the rate over time in `bucket_s` buckets. A
     failed transfer is followed by a 0.1 s pause (a caller's back-off).
  3. With `--cluster`: a whole cluster in a 3-host test network, the busiest decode instance's host partitioned
     and then its process SIGSTOPped under `streams` streams (network_cluster.py), as `faults.cluster_partition`
     and `faults.cluster_sigstop`; then an elastic fleet on etcd in a 4-host test network, one host's links at a
     tenth of the others' rate (network_fleet_faults.py): `faults.cluster_nic_down_load` (NIC 1 of the slow host
     down for `fault_s`, at most 1.5 s, under `fleet_requests` large prefix loads from its store),
     `faults.cluster_slow_link` (after one measured fetch over the slow links, where the conductor places prompts
     whose prefix only the slow host holds) and `faults.cluster_etcd_cut` (the leading conductor cut off etcd).
     `hung` and `lost` are totals over every fault.
Needs root (network namespaces); without, it says why and exits 2.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from mooncaked.bench import network_cluster, network_fleet_faults, testnet
from mooncaked.bench.network_driver import PeerProcess, seconds, start_client, start_server
from mooncaked.bench.report import report

MIB = 1 << 20
_BACKOFF_S = 0.1
_COUNTS = ("requests", "completed", "failed", "lost", "hung", "migrated", "recovery_s")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rate-mbit", type=float, default=100.0, help="every link's rate, both directions")
    parser.add_argument("--mib", type=int, default=16, help="multi_nic: MiB per transfer")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fault-mib", type=int, default=8, help="faults: MiB per transfer")
    parser.add_argument("--lead-s", type=float, default=3.0)
    parser.add_argument("--fault-s", type=float, default=4.0)
    parser.add_argument("--tail-s", type=float, default=5.0)
    parser.add_argument("--bucket-s", type=float, default=0.5)
    parser.add_argument("--transfer-timeout-s", type=float, default=10.0)
    parser.add_argument("--cooldown-s", type=float, default=1.0, help="transfer.path_cooldown_s of the client")
    parser.add_argument("--io-timeout-s", type=float, default=1.0, help="transfer.io_timeout_s of both ends: a "
                        "failed link is noticed after 1 to 2 times this")
    parser.add_argument("--cluster", action="store_true", help="also partition a host, and stop a process, under "
                        "a whole cluster's streams (network_cluster.py); then a NIC down under prefix loads, a slow "
                        "link's placement and etcd cut off from the leading conductor (network_fleet_faults.py)")
    parser.add_argument("--streams", type=int, default=6, help="--cluster: concurrent streams")
    parser.add_argument("--max-tokens", type=int, default=900, help="--cluster: tokens per stream")
    parser.add_argument("--partition-s", type=float, default=5.0, help="--cluster: how long a fault lasts")
    parser.add_argument("--stream-timeout-s", type=float, default=120.0, help="--cluster: a stream not ended "
                        "by then is hung")
    parser.add_argument("--fleet-requests", type=int, default=4, help="--cluster: prefix loads or requests per "
                        "round of the elastic fleet (network_fleet_faults.py)")
    parser.add_argument("--start-timeout-s", type=float, default=180.0)
    parser.add_argument("--json", default=None, help="write the result here")


def run(args: argparse.Namespace) -> int:
    reason = testnet.unavailable_reason()
    if reason:
        print(f"bench network: {reason}")
        return 2
    engine_args = ["--timeout-s", str(args.transfer_timeout_s), "--cooldown-s", str(args.cooldown_s),
                   "--io-timeout-s", str(args.io_timeout_s)]
    with testnet.TestNet(2, 2, args.rate_mbit) as net:
        server_bytes = max(args.mib, args.fault_mib) * MIB
        server, endpoint = start_server(net, 1, server_bytes, ["--io-timeout-s", str(args.io_timeout_s)])
        clients = {num_nics: start_client(net, 0, endpoint, args.mib * MIB, num_nics,
                                          [*engine_args, "--source-bytes", str(server_bytes)]) for num_nics in (1, 2)}
        multi_nic = measure_multi_nic(clients, server, args)
        faulty = start_client(net, 0, endpoint, args.fault_mib * MIB, 2,
                              [*engine_args, "--source-bytes", str(server_bytes)])
        faults = {
            "nic_down": run_fault(faulty, lambda: net.set_link(1, 1, False), lambda: net.set_link(1, 1, True), args),
            "partition": run_fault(faulty, lambda: net.partition(1), lambda: net.heal(1), args),
        }
    if args.cluster:
        faults.update(network_cluster.run_faults(args))
        faults.update(network_fleet_faults.run_fleet_faults(args))
    result = {"rate_mbit": args.rate_mbit, **multi_nic, "faults": faults,
              "hung": sum(f["hung"] for f in faults.values()), "lost": sum(f["lost"] for f in faults.values())}
    report(result, table(result), args.json)
    return 0


def measure_multi_nic(clients: dict[int, PeerProcess], server: PeerProcess,
                      args: argparse.Namespace) -> dict[str, Any]:
    rates: dict[int, list[float]] = {1: [], 2: []}
    cpu_share: dict[str, list[float]] = {"client": [], "server": []}
    for client in clients.values():
        client.fetch(1)  # warm-up: the link learns the server's NICs and connects
    for _ in range(args.repeats):
        for num_nics, client in clients.items():
            cpu_before = (client.cpu_seconds(), server.cpu_seconds())
            (transfer,), _ = client.fetch(1)
            if not transfer["is_intact"]:
                raise RuntimeError(f"a healthy transfer failed: {transfer}")
            rates[num_nics].append(mbit_per_s(transfer["bytes"], seconds(transfer)))
            if num_nics == 2:
                cpu_share["client"].append((client.cpu_seconds() - cpu_before[0]) / seconds(transfer))
                cpu_share["server"].append((server.cpu_seconds() - cpu_before[1]) / seconds(transfer))
    one, two = statistics.median(rates[1]), statistics.median(rates[2])
    return {"multi_nic_ratio": round(two / one, 3), "one_nic_mbit_s": rates[1], "two_nic_mbit_s": rates[2],
            "link_utilisation_2nic": round(two / (2 * args.rate_mbit), 3),
            "cpu_share_2nic": {name: round(max(shares), 3) for name, shares in cpu_share.items()}}


def run_fault(client: PeerProcess, fail: Callable[[], None], heal: Callable[[], None],
              args: argparse.Namespace) -> dict[str, Any]:
    start = time.monotonic()
    fail_at, heal_at = start + args.lead_s, start + args.lead_s + args.fault_s
    schedule = threading.Thread(target=_apply_at, args=([(fail_at, fail), (heal_at, heal)],), name="bench-fault")
    schedule.start()
    transfers = []
    try:
        while time.monotonic() < heal_at + args.tail_s:
            (transfer,), _ = client.fetch(1)
            transfers.append(transfer)
            if transfer["error"] is not None:
                time.sleep(_BACKOFF_S)  # as a caller would before trying again
    finally:
        schedule.join()  # bounded: it ends at heal_at
    return summarize_fault(transfers, fail_at, heal_at, start, args)


def _apply_at(events: list[tuple[float, Callable[[], None]]]) -> None:
    for at, action in events:
        time.sleep(max(at - time.monotonic(), 0.0))
        action()


def summarize_fault(transfers: list[dict[str, Any]], fail_at: float, heal_at: float, start: float,
                    args: argparse.Namespace) -> dict[str, Any]:
    intact = [t for t in transfers if t["is_intact"]]
    end = max((t["end"] for t in transfers), default=start)
    buckets = rate_buckets(intact, start, end, args.bucket_s)
    healthy = statistics.median([mbit_per_s(t["bytes"], seconds(t)) for t in intact if t["end"] <= fail_at] or [0])
    recovered = [t for t in intact if t["start"] >= heal_at and mbit_per_s(t["bytes"], seconds(t)) >= 0.8 * healthy]
    return {
        "requests": len(transfers), "completed": len(intact),
        "failed": sum(t["error"] is not None for t in transfers),
        "lost": sum(t["error"] is None and not t["is_intact"] for t in transfers),
        "hung": sum(seconds(t) > args.transfer_timeout_s + 1.0 for t in transfers),
        "migrated": sum(t["start"] < heal_at and t["end"] > fail_at for t in intact),
        "completed_after_heal": sum(t["start"] >= heal_at for t in intact),
        "recovery_s": round(recovered[0]["end"] - heal_at, 2) if recovered else None,
        "mbit_s_before": window_mean(buckets, args.bucket_s, fail_at - start, args.bucket_s),
        "mbit_s_during": window_mean(buckets, fail_at - start + args.bucket_s, heal_at - start, args.bucket_s),
        "mbit_s_failed_over": window_mean(buckets, fail_at - start + 2 * args.io_timeout_s + args.bucket_s,
                                          heal_at - start, args.bucket_s),
        "mbit_s_after": window_mean(buckets, heal_at - start + args.cooldown_s + args.bucket_s, end - start,
                                    args.bucket_s),
        "fault_at_s": round(fail_at - start, 2), "heal_at_s": round(heal_at - start, 2),
        "mbit_s_by_bucket": [round(rate, 1) for rate in buckets],
    }


def rate_buckets(transfers: list[dict[str, Any]], start: float, end: float, bucket_s: float) -> list[float]:
    """Mbit/s in each `bucket_s` from `start`, each transfer's bytes spread evenly over its time."""
    num_buckets = max(int((end - start) / bucket_s), 1)
    bits = [0.0] * num_buckets
    for t in transfers:
        rate = t["bytes"] * 8 / seconds(t)
        for index in range(num_buckets):
            lo, hi = start + index * bucket_s, start + (index + 1) * bucket_s
            bits[index] += rate * max(min(hi, t["end"]) - max(lo, t["start"]), 0.0)
    return [b / bucket_s / 1e6 for b in bits]


def window_mean(buckets: list[float], from_s: float, to_s: float, bucket_s: float) -> float | None:
    """The mean of the buckets lying wholly in [from_s, to_s) (seconds from the run's start)."""
    inside = [rate for i, rate in enumerate(buckets) if i * bucket_s >= from_s and (i + 1) * bucket_s <= to_s]
    return round(statistics.mean(inside), 1) if inside else None


def mbit_per_s(num_bytes: int, duration_s: float) -> float:
    return num_bytes * 8 / duration_s / 1e6


def table(result: dict[str, Any]) -> str:
    lines = [f"links {result['rate_mbit']:g} mbit; 1 NIC {statistics.median(result['one_nic_mbit_s']):.1f} "
             f"Mbit/s, 2 NICs {statistics.median(result['two_nic_mbit_s']):.1f} Mbit/s: multi_nic_ratio "
             f"{result['multi_nic_ratio']:.2f} (link utilisation {result['link_utilisation_2nic']:.2f}, CPU share "
             f"{result['cpu_share_2nic']})",
             f"{'fault':<10} {'requests':>8} {'completed':>9} {'failed':>6} {'lost':>4} {'hung':>4} {'migrated':>8} "
             f"{'recovery_s':>10} {'before':>7} {'during':>7} {'f.over':>7} {'after':>7}  (Mbit/s)"]
    for name, fault in result["faults"].items():
        if name.startswith("cluster_") and "victim" not in fault:
            details = {key: value for key, value in fault.items() if key not in _COUNTS}
            lines.append(f"{name}: " + ", ".join(f"{fault[key]} {key}" for key in _COUNTS) + f"; {details}")
            continue
        if name.startswith("cluster_"):
            lines.append(f"{name}: {fault['victim']} (running {fault['running_at_fault']}): "
                         f"{fault['requests']} streams, {fault['completed']} completed, {fault['failed']} failed, "
                         f"{fault['lost']} lost, {fault['hung']} hung, {fault['migrated']} migrated, recovery "
                         f"{fault['recovery_s']} s, stream s {fault['stream_s']} (undisturbed "
                         f"{fault['undisturbed_stream_s']}), errors {fault['errors']}")
            continue
        lines.append(f"{name:<10} {fault['requests']:>8} {fault['completed']:>9} {fault['failed']:>6} "
                     f"{fault['lost']:>4} {fault['hung']:>4} {fault['migrated']:>8} {fault['recovery_s']!s:>10} "
                     f"{fault['mbit_s_before']!s:>7} {fault['mbit_s_during']!s:>7} "
                     f"{fault['mbit_s_failed_over']!s:>7} {fault['mbit_s_after']!s:>7}")
    return "\n".join(lines)
