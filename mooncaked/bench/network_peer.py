"""A transfer engine in its own process, for runs inside a test network's host (testnet.py `exec`).

`python -m mooncaked.bench.network_peer serve --host A --nics nic0=10.77.0.2/24,... --bytes N --seed S`
registers segment "src" of N seeded random bytes, prints {"endpoint": "A:port"} and serves until its stdin
closes.

`python -m mooncaked.bench.network_peer fetch --host A --nics ... --endpoint E --bytes N --seed S` prints
{"ready": true}, then per stdin line "fetch K" READs the first N bytes of the peer's "src" (of
`--source-bytes`, default N) K times in a row, printing per
transfer {"start", "end" (time.monotonic, the same clock in every namespace), "bytes", "is_intact" (its
sha256 equals that of the seeded bytes), "error"}, then {"done": true, "path_states": {...}}; it ends when its
stdin closes.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import sys
import time
from typing import Any

import numpy as np

from mooncaked.transfer import SegmentRef, TransferEngine, TransferError, TransferOp, TransferRequest
from mooncaked.transfer.nics import Nic

logger = logging.getLogger(__name__)
CLUSTER_ID = "testnet"


def parse_nics(text: str) -> list[Nic]:
    """"name=address[/prefix],..." -> NICs ("" -> none)."""
    nics = []
    for item in filter(None, text.split(",")):
        name, sep, address = item.partition("=")
        if not sep:
            raise ValueError(f"--nics items look like nic0=10.77.0.1/24, got {item!r}")
        nics.append(Nic.parse(name, address))
    return nics


def format_nics(nics: list[tuple[str, str]]) -> str:
    return ",".join(f"{name}={address}" for name, address in nics)


def seeded_bytes(num_bytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, num_bytes, dtype=np.uint8)


def make_engine(args: argparse.Namespace) -> TransferEngine:
    return TransferEngine(
        host=args.host, transports=("tcp",), nics=parse_nics(args.nics), cluster_id=CLUSTER_ID,
        num_connections_per_peer=args.connections, tcp_frame_bytes=args.frame_bytes, io_timeout_s=args.io_timeout_s,
        connect_timeout_s=args.connect_timeout_s, path_cooldown_s=args.cooldown_s, max_retries=args.max_retries)


async def serve(args: argparse.Namespace) -> None:
    engine = make_engine(args)
    await engine.start()
    try:
        engine.register("src", seeded_bytes(args.bytes, args.seed))
        _emit({"endpoint": engine.endpoint})
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until stdin closes
    finally:
        await engine.stop()


async def fetch(args: argparse.Namespace) -> None:
    engine = make_engine(args)
    await engine.start()
    try:
        source = seeded_bytes(args.source_bytes or args.bytes, args.seed)
        expected = hashlib.sha256(source[: args.bytes].tobytes()).digest()
        dst = np.zeros(args.bytes, np.uint8)
        engine.register("dst", dst)
        _emit({"ready": True})
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            command, _, count = line.strip().partition(" ")
            if command != "fetch" or not count.isdigit():
                _emit({"error": f"unknown command {line.strip()!r}: send 'fetch K'"})
                continue
            for _ in range(int(count)):
                _emit(await _fetch_once(engine, args, dst, expected))
            _emit({"done": True, "path_states": engine.path_states(args.endpoint)})
    finally:
        await engine.stop()


async def _fetch_once(engine: TransferEngine, args: argparse.Namespace, dst: np.ndarray,
                      expected: bytes) -> dict[str, Any]:
    dst[:] = 0
    request = TransferRequest(TransferOp.READ, "dst", 0, SegmentRef(args.endpoint, "src"), 0, args.bytes)
    start = time.monotonic()
    error = None
    try:
        await engine.wait(engine.submit([request]), timeout_s=args.timeout_s)
    except TransferError as exc:
        error = str(exc)
    end = time.monotonic()
    return {"start": start, "end": end, "bytes": args.bytes, "error": error,
            "is_intact": error is None and hashlib.sha256(dst.data).digest() == expected}


def _emit(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mooncaked.bench.network_peer")
    parser.add_argument("mode", choices=("serve", "fetch"))
    parser.add_argument("--host", required=True)
    parser.add_argument("--nics", default="")
    parser.add_argument("--endpoint", default="")
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--source-bytes", type=int, default=0, help="fetch: the server's --bytes (0: --bytes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--frame-bytes", type=int, default=1 << 20)
    parser.add_argument("--io-timeout-s", type=float, default=1.0)
    parser.add_argument("--connect-timeout-s", type=float, default=0.5)
    parser.add_argument("--cooldown-s", type=float, default=1.0)
    parser.add_argument("--max-retries", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    asyncio.run(serve(args) if args.mode == "serve" else fetch(args))


if __name__ == "__main__":
    main()
