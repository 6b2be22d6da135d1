"""The fleet of `mooncaked bench elastic`: etcd on loopback and one process per instance, each with its own config.

1. `start()` starts etcd and a membership reader (the benchmark follows the membership itself, as a reader of
   etcd); `start_fleet()` then spawns the store, three switchable workers (two prefill, one decode) and two
   conductors.
2. `spawn(name, role)` writes a config naming only that instance plus the etcd endpoints, starts
   `mooncaked --role R --config OWN.yaml` with its log in the fleet's directory, and returns when the instance
   registered as ready (or raises with its log's tail). `kill(name)` sends it SIGKILL.
3. `stop()` sends SIGTERM to every process, newest first, killing the process group of one that does not exit
   within 30 s; then stops the reader and etcd, last.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from mooncaked.bench.cluster import free_port
from mooncaked.bench.etcd_server import EtcdServer
from mooncaked.cluster.etcd_membership import EtcdMembership
from mooncaked.config import load_config


class Fleet:
    """Owns the etcd server, one process per instance, their configs and logs, and a membership reader."""

    def __init__(self, root: Path, args: argparse.Namespace, is_controller_on: bool) -> None:
        self.root, self.args, self.is_controller_on = root, args, is_controller_on
        self.etcd = EtcdServer(root / "etcd")
        self.processes: dict[str, asyncio.subprocess.Process] = {}
        self.ports: dict[str, int] = {}
        self.reader: EtcdMembership | None = None

    def _config(self, name: str, role: str) -> Path:
        entry: dict[str, Any] = {"name": name, "role": role, "host": "127.0.0.1", "port": free_port()}
        if role == "store":
            entry["data_port"] = free_port()
        self.ports[name] = entry["port"]
        args = self.args
        data = {
            "cluster": {"id": "elastic", "membership": "etcd", "instances": [entry],
                        "etcd": {"endpoints": [self.etcd.endpoint], "lease_ttl_s": args.lease_ttl_s,
                                 "call_timeout_s": 1.0, "min_backoff_s": 0.1, "max_backoff_s": 1.0,
                                 "drain_notice_s": 0.3}},
            "model": {"source": args.model, "name": "bench", "max_model_len": 1024},
            "kv": {"block_size": 16},
            "runtime": {"drain_timeout_s": 5.0},
            "store": {"dram_bytes": 256 << 20, "shm_dir": str(self.root), "maintenance_interval_s": 0.05},
            "worker": {"num_kv_pages": 256, "max_batch_size": args.max_batch_size, "switchable": True,
                       "inline_prefill_max_tokens": 0, "abort_grace_s": 1.0},
            "scheduler": {"admission": "none", "ttft_slo_ms": args.ttft_slo_ms, "tbt_slo_ms": args.tbt_slo_ms},
            "conductor": {"load_poll_interval_s": 0.1},
            "pd_controller": {"enabled": self.is_controller_on, "interval_s": 0.5, "window": 4, "num_confirm": 2,
                              "dwell_s": 4.0, "tolerance": 0.5, "switch_timeout_s": 10.0, "switch_cost_s": 2.0},
        }
        path = self.root / f"{name}.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path

    async def start(self) -> None:
        await self.etcd.start()
        config = load_config(self._config("reader", "conductor"))
        self.reader = EtcdMembership(config, None)
        await self.reader.start()

    async def spawn(self, name: str, role: str, timeout_s: float = 120.0) -> float:
        """Start one instance; returns the monotonic time it registered as ready."""
        path = self._config(name, role)
        log = open(self.root / f"{name}.log", "ab")
        with log:
            self.processes[name] = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "mooncaked", "--role", role, "--config", str(path),
                stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.reader is not None
            record = self.reader.members().get(name)
            if record is not None and record.is_ready:
                return time.monotonic()
            if self.processes[name].returncode is not None:
                break
            await asyncio.sleep(0.01)
        raise RuntimeError(f"{name} did not become ready:\n{self.log_tail(name)}")

    def kill(self, name: str) -> float:
        process = self.processes.pop(name)
        os.kill(process.pid, signal.SIGKILL)
        return time.monotonic()

    async def stop(self) -> None:
        for name in reversed(list(self.processes)):
            process = self.processes.pop(name)
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), 30.0)
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                await process.wait()
        if self.reader is not None:
            await self.reader.stop()
        await self.etcd.stop()

    def log_tail(self, name: str) -> str:
        with contextlib.suppress(OSError):
            return (self.root / f"{name}.log").read_text(errors="replace")[-3000:]
        return ""

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    async def start_fleet(self) -> None:
        await self.start()
        await self.spawn("s0", "store")
        for name, role in (("w0", "prefill"), ("w1", "prefill"), ("w2", "decode")):
            await self.spawn(name, role)
        await self.spawn("c0", "conductor")
        await self.spawn("c1", "conductor")
