"""Warm restarts: a store process stopped with SIGTERM writes its DRAM blocks to its SSD tier; restarted, it serves
them to the workers that kept running (same-host workers map its new pool), with checksums verified: a corrupt
file is dropped and never served, and the answer stays right."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mooncaked.model.loader import load_model
from mooncaked.roles.base import PeerClients
from tests.roles.cluster_fixtures import cluster_config, instance, running_roles
from tests.roles.engine_reference import greedy_tokens
from tests.roles.test_disagg_roles import generate, keys_for


@contextmanager
def store_process(config_path: Path, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`mooncaked --role store` as a process of its own, returned once it reported READY=1."""
    notify_path = str(tmp_path / f"notify-{os.urandom(4).hex()}.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(notify_path)
        notify.settimeout(60)
        process = subprocess.Popen([sys.executable, "-m", "mooncaked", "--role", "store", "--config",
                                    str(config_path), "--instance", "s0"], env={**os.environ,
                                                                                "NOTIFY_SOCKET": notify_path})
        try:
            assert notify.recv(100) == b"READY=1"
            yield process
        finally:
            if process.poll() is None:
                process.kill()
            process.wait(30)


def stop_with_sigterm(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 0


async def test_a_sigtermed_store_comes_back_warm_and_drops_a_corrupt_block(tmp_path: Path) -> None:
    ssd_dir = tmp_path / "ssd"
    config = cluster_config(tmp_path, [instance("s0", "store"), instance("p0", "prefill"), instance("d0", "decode")],
                            store={"ssd_dir": str(ssd_dir), "ssd_bytes": 64 << 20},
                            worker={"inline_prefill_max_tokens": 0},
                            # the store's tier under test: p0's device prefix cache would serve the prefix itself
                            kv={"block_size": 16, "device_prefix_cache": False})
    config_path = tmp_path / "cluster.yaml"
    tokens = [random.Random(5).randrange(3, 300) for _ in range(80)]  # 5 full blocks of 16
    keys = keys_for(config, tokens)
    expected = greedy_tokens(load_model("random:tiny"), tokens, 6)
    with store_process(config_path, tmp_path) as store:
        async with running_roles(config, ["p0", "d0"]):
            clients = PeerClients(config, config.instance_named("p0"))
            try:
                assert await generate(config, clients, "cold", tokens, 6) == (expected, 0)
                assert await generate(config, clients, "warm", tokens, 6) == (expected, 64)
                assert not ssd_dir.exists() or not os.listdir(ssd_dir / "s0"), "nothing evicted yet: all in DRAM"
                await asyncio.to_thread(stop_with_sigterm, store)
                files = set(os.listdir(ssd_dir / "s0"))
                assert {key.hex() + ".blk" for key in keys} <= files, "the prompt's blocks were written on SIGTERM"
                corrupt = ssd_dir / "s0" / (keys[3].hex() + ".blk")
                with open(corrupt, "r+b") as file:
                    file.seek(-7, os.SEEK_END)
                    file.write(b"garbage")
                with store_process(config_path, tmp_path):
                    # The prefix is a hit up to the corrupt block, which is dropped, recomputed and stored again.
                    assert await generate(config, clients, "restarted", tokens, 6) == (expected, 48)
                    assert await generate(config, clients, "again", tokens, 6) == (expected, 64)
            finally:
                await clients.close()
