"""`mooncaked bench transfer`: bulk bytes between two processes over loopback, our engine vs its baselines.

Stages:
  1. Start the receivers (spawned processes): an engine with a `sink` segment, a raw-socket receiver, and the two
     gloo ranks. Each system moves `total` bytes as `request`-sized writes, `in_flight` outstanding, into a ring of
     `in_flight` request-sized slots:
     - engine: TransferEngine tcp transport, one batch per request (WRITE), `connections` data connections;
     - engine_auth: the same with a cluster secret on both engines (every data connection runs the HMAC
       challenge-response first). Both engine systems start each pass from a fresh sender engine, so every pass
       pays its connections' set-up and handshakes;
     - raw_socket: the ceiling: blocking sockets, one thread per connection (`connections`), sendall from a
       memoryview, recv_into the destination slot;
     - gloo: torch.distributed gloo isend/irecv between two spawned ranks (init over tcp://127.0.0.1), timed on
       the receiver;
     - memcpy: numpy copy of the same bytes within this process.
  2. Rounds: each round runs one pass of every system in turn, so all see the same load; the order rotates from
     round to round so no system always runs first (or right after memcpy). The first round is an unmeasured
     warm-up (connections, page faults), then `repeats` measured rounds; each system's best pass counts (the
     machine is shared). Every pass is in the JSON too.
  3. Handshakes alone: `handshake_samples` fresh connections to each receiver engine, connect plus handshake,
     with and without the secret, alternating; medians in milliseconds.
  4. Print a table; write JSON with engine_gbps, engine_auth_gbps, raw_socket_gbps, gloo_gbps, memcpy_gbps
     (GB/s = 1e9 B/s), ratio_vs_raw and ratio_vs_gloo (targets >= 0.8 and >= 1.2), auth_overhead (the median over
     rounds of engine_auth's pass time over engine's in the same round, minus 1; target < 0.02), the handshake
     medians and handshake_share (the handshakes of one pass over its time), and each system's CPU seconds per
     GiB (sender and receiver processes together; on a shared machine this varies less than GB/s).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import multiprocessing
import os
import socket
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from mooncaked.bench.cluster import free_port
from mooncaked.bench.report import write_json
from mooncaked.bench.transfer_baselines import (
    END,
    HEADER,
    TIMEOUT_S,
    Plan,
    gloo_pass,
    gloo_rank,
    memcpy_pass,
    raw_pass,
    make_ring,
    raw_receiver,
)

MIB = 1 << 20
SYSTEMS = ("engine", "engine_auth", "raw_socket", "gloo", "memcpy")
ENGINE_SYSTEMS = ("engine", "engine_auth")
_CLUSTER = "bench-transfer"
_SECRET = b"bench-transfer-secret"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON to FILE")
    parser.add_argument("--total-gib", type=float, default=1.0, help="bytes moved per pass, GiB (default 1)")
    parser.add_argument("--request-mib", type=int, default=64, help="bytes per request, MiB (default 64)")
    parser.add_argument("--in-flight", type=int, default=8, help="requests outstanding (default 8)")
    parser.add_argument("--connections", type=int, default=4, help="data connections per peer (default 4)")
    parser.add_argument("--repeats", type=int, default=5, help="measured rounds; best pass counts (default 5)")
    parser.add_argument("--handshake-samples", type=int, default=200,
                        help="fresh connections timed per handshake kind (default 200)")


def run(args: argparse.Namespace) -> int:
    request_bytes = args.request_mib * MIB
    total = max(int(args.total_gib * (1 << 30)) // request_bytes, 1) * request_bytes
    plan = Plan(total, request_bytes, args.in_flight, args.connections, max(args.repeats, 1))
    seconds, cpu_seconds, handshake_s = asyncio.run(
        _measure(plan, multiprocessing.get_context("spawn"), max(args.handshake_samples, 1)))
    report: dict[str, Any] = {f"{name}_gbps": _gbps(plan, seconds[name]) for name in SYSTEMS}
    for name in SYSTEMS:  # CPU seconds (both processes) per GiB: less sensitive than GB/s to a shared machine
        report[f"{name}_cpu_s_per_gib"] = min(cpu_seconds[name][1:]) / (plan.total_bytes / (1 << 30))
    report["ratio_vs_raw"] = report["engine_gbps"] / report["raw_socket_gbps"]
    report["ratio_vs_gloo"] = report["engine_gbps"] / report["gloo_gbps"]
    paired = [auth / plain for auth, plain in zip(seconds["engine_auth"][1:], seconds["engine"][1:])]
    report["auth_overhead"] = statistics.median(paired) - 1.0
    report["auth_overhead_per_round"] = [round(ratio - 1.0, 4) for ratio in paired]
    for kind, samples in handshake_s.items():
        report[f"handshake_ms_{kind}"] = statistics.median(samples) * 1e3
    report["handshake_share"] = (plan.connections * statistics.median(handshake_s["secret"])
                                 / statistics.median(seconds["engine_auth"][1:]))
    report.update(
        total_bytes=plan.total_bytes, request_bytes=plan.request_bytes, in_flight=plan.in_flight,
        connections=plan.connections, repeats=plan.repeats,
        pass_gbps={name: [round(plan.total_bytes / s / 1e9, 3) for s in seconds[name][1:]] for name in SYSTEMS},
    )
    _print_table(report)
    if args.json:
        write_json(args.json, report)
    return 0


def _gbps(plan: Plan, seconds: list[float]) -> float:
    """GB/s of the best measured pass; seconds[0] is the warm-up."""
    return plan.total_bytes / min(seconds[1:]) / 1e9


def _print_table(report: dict[str, Any]) -> None:
    print(f"transfer: {report['total_bytes'] / (1 << 30):g} GiB in {report['request_bytes'] // MIB} MiB requests, "
          f"{report['in_flight']} in flight, {report['connections']} connections, loopback, two processes")
    print(f"{'system':<12}{'GB/s':>8}{'CPU s/GiB':>11}   every pass (GB/s)")
    for name in SYSTEMS:
        passes = " ".join(f"{gbps:.2f}" for gbps in report["pass_gbps"][name])
        print(f"{name:<12}{report[name + '_gbps']:>8.2f}{report[name + '_cpu_s_per_gib']:>11.2f}   {passes}")
    print(f"ratio_vs_raw  {report['ratio_vs_raw']:.2f}  (target >= 0.8)")
    print(f"ratio_vs_gloo {report['ratio_vs_gloo']:.2f}  (target >= 1.2)")
    print(f"auth_overhead {report['auth_overhead'] * 100:+.2f}%  (target < 2%; per round "
          f"{', '.join(f'{r * 100:+.1f}%' for r in report['auth_overhead_per_round'])})")
    print(f"handshake     {report['handshake_ms_secret']:.3f} ms with the secret, "
          f"{report['handshake_ms_open']:.3f} ms without (connect included); "
          f"{report['handshake_share'] * 100:.3f}% of a pass")


async def _measure(plan: Plan, context: Any, num_handshakes: int) -> tuple[dict[str, list[float]],
                                                                         dict[str, list[float]],
                                                                         dict[str, list[float]]]:
    """Wall seconds and CPU seconds (sender and receiver processes) per pass of every system, round by round;
    seconds per fresh connection and handshake, with and without the secret."""
    from mooncaked.transfer import SegmentRef

    engine_pipe, engine_child = context.Pipe()
    raw_pipe, raw_child = context.Pipe()
    gloo_pipes = [context.Pipe() for _ in range(2)]
    gloo_port = free_port()
    children = [
        context.Process(target=_engine_receiver, args=(engine_child, plan), daemon=True),
        context.Process(target=raw_receiver, args=(raw_child, plan), daemon=True),
        *(
            context.Process(target=gloo_rank, args=(rank, gloo_port, plan, gloo_pipes[rank][1]), daemon=True)
            for rank in (0, 1)
        ),
    ]
    for child in children:
        child.start()
    gloo = [pipe for pipe, _ in gloo_pipes]
    ring, memcpy_ring = make_ring(plan), make_ring(plan)
    sockets: list[socket.socket] = []
    seconds: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    cpu_seconds: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    try:
        if not all(pipe.poll(TIMEOUT_S) for pipe in (engine_pipe, raw_pipe, *gloo)):
            raise RuntimeError("the receiver processes did not start")
        endpoints = engine_pipe.recv()  # another host address: never the same-host memcpy path
        refs = {name: SegmentRef(endpoint, "sink") for name, endpoint in zip(ENGINE_SYSTEMS, endpoints)}
        raw_port = raw_pipe.recv()
        sockets = [socket.create_connection(("127.0.0.1", raw_port)) for _ in range(plan.connections)]
        for pipe in gloo:
            pipe.recv()
        pids = {"engine": [children[0].pid], "engine_auth": [children[0].pid], "raw_socket": [children[1].pid],
                "gloo": [c.pid for c in children[2:]]}
        for round_index in range(plan.repeats + 1):
            for name in SYSTEMS[round_index % len(SYSTEMS) :] + SYSTEMS[: round_index % len(SYSTEMS)]:
                cpu_before = _cpu_seconds(pids.get(name, []))
                if name in ENGINE_SYSTEMS:
                    seconds[name].append(await _engine_pass(plan, name == "engine_auth", ring, refs[name]))
                elif name == "raw_socket":
                    seconds[name].append(raw_pass(plan, sockets, memoryview(ring.data)))
                elif name == "gloo":
                    seconds[name].append(gloo_pass(gloo))
                else:
                    seconds[name].append(memcpy_pass(plan, ring, memcpy_ring))
                cpu_seconds[name].append(_cpu_seconds(pids.get(name, [])) - cpu_before)
        return seconds, cpu_seconds, _time_handshakes(endpoints, num_handshakes)
    finally:
        for sock in sockets:
            sock.sendall(HEADER.pack(0, END))
            sock.close()
        for pipe in (engine_pipe, *gloo):
            pipe.send("stop")
        for child in children:
            child.join(10)


def _cpu_seconds(child_pids: list[int | None]) -> float:
    """User + system CPU seconds of this process (for gloo only its idle coordination) and of the children."""
    own = os.times()
    total = own.user + own.system
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    for pid in child_pids:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / ticks_per_s  # utime, stime
    return total


# engine ----------------------------------------------------------------------------------------------------------


def _engine_receiver(conn: Connection, plan: Plan) -> None:
    """Two engines over one ring: without a secret (system `engine`) and with one (`engine_auth`)."""

    async def main() -> None:
        sink = make_ring(plan)
        engines = [_make_engine("127.0.0.2", plan, is_auth) for is_auth in (False, True)]
        for engine in engines:
            await engine.start()
            engine.register("sink", sink)
        conn.send([engine.endpoint for engine in engines])
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        for engine in engines:
            await engine.stop()

    asyncio.run(main())


def _make_engine(host: str, plan: Plan, is_auth: bool) -> Any:
    from mooncaked.transfer import TransferEngine

    return TransferEngine(host=host, num_connections_per_peer=plan.connections, cluster_id=_CLUSTER,
                          secret=_SECRET if is_auth else None)


async def _engine_pass(plan: Plan, is_auth: bool, ring: np.ndarray, ref: Any) -> float:
    """One pass from a fresh sender engine: its connections (and handshakes) are part of the pass."""
    engine = _make_engine("127.0.0.1", plan, is_auth)
    await engine.start()
    engine.register("ring", ring)
    try:
        return await _engine_writes(plan, engine, ref)
    finally:
        await engine.stop()


async def _engine_writes(plan: Plan, engine: Any, ref: Any) -> float:
    from mooncaked.transfer import TransferOp, TransferRequest

    started = time.perf_counter()
    pending: collections.deque[int] = collections.deque()
    for index in range(plan.num_requests):
        if len(pending) == plan.in_flight:
            await engine.wait(pending.popleft(), TIMEOUT_S)
        offset = (index % plan.in_flight) * plan.request_bytes
        request = TransferRequest(TransferOp.WRITE, "ring", offset, ref, offset, plan.request_bytes)
        pending.append(engine.submit([request]))
    for batch_id in pending:
        await engine.wait(batch_id, TIMEOUT_S)
    return time.perf_counter() - started


def _time_handshakes(endpoints: list[str], num_samples: int) -> dict[str, list[float]]:
    """Seconds per fresh connection plus handshake to each receiver engine, the two kinds alternating."""
    from mooncaked.transfer.handshake import DataCredentials, client_handshake
    from mooncaked.transfer.types import split_endpoint

    kinds = {"open": (endpoints[0], DataCredentials(_CLUSTER)),
             "secret": (endpoints[1], DataCredentials(_CLUSTER, _SECRET))}
    samples: dict[str, list[float]] = {kind: [] for kind in kinds}
    for _ in range(num_samples):
        for kind, (endpoint, credentials) in kinds.items():
            started = time.perf_counter()
            with socket.create_connection(split_endpoint(endpoint), timeout=TIMEOUT_S) as sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                client_handshake(sock, credentials, endpoint)
                samples[kind].append(time.perf_counter() - started)
    return samples


if __name__ == "__main__":
    cli = argparse.ArgumentParser(prog="mooncaked bench transfer")
    add_arguments(cli)
    raise SystemExit(run(cli.parse_args()))
