"""Local clusters for the benchmarks: free loopback ports, a generated YAML, and `--role all` as a process tree.

1. `instance(name, role, host)` builds one `cluster.instances` entry on free ports of `host`;
   `write_config(path, cluster_id, instances, sections)` writes the YAML (load it back with `load_config`
   to start roles in this process).
2. `ClusterProcess(config_path, url, log_path)`: `await start(timeout_s)` spawns
   `python -m mooncaked --role all --config FILE` in its own session and polls `GET /health` until it answers
   200, the process exits, or the deadline passes (then it is stopped and the log's tail is raised).
3. `await stop(timeout_s)` sends SIGTERM to the supervisor (it stops its children), waits, and SIGKILLs the
   process group it created past the deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import yaml


_handed_out: set[int] = set()  # ports free_port returned in this process (the kernel may offer one again)
_port_choice = random.Random(os.getpid() ^ time.monotonic_ns())  # processes picking at once pick apart
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, below the kernel's ephemeral range, and not returned before by this process: a
    config built from several calls never names one port twice, and no outgoing connection's local port or
    port-0 bind (a tensor-parallel rendezvous, gloo) takes it before its instance binds it, as one picked from
    the ephemeral range can be."""
    first, last = ephemeral_range()
    low, high = (max(1024, first - 16384), first) if first > 2048 else (last + 1, 65536)  # [low, high)
    for _ in range(1000):
        port = _port_choice.randrange(low, high)
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:  # in use, or lingering after a close
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port on {host} below the ephemeral range that this process has not handed out "
                       "already")


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ephemeral ports (Linux's default where it cannot be read)."""
    try:
        low, high = EPHEMERAL_RANGE_FILE.read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def instance(name: str, role: str, host: str = "127.0.0.1", **extra: Any) -> dict[str, Any]:
    """One instance entry with free ports (a store also gets a data port, a conductor no RPC port)."""
    entry: dict[str, Any] = {"name": name, "role": role, "host": host, "port": free_port(host)}
    if role == "store":
        entry["data_port"] = free_port(host)
    entry.update(extra)
    return entry


def write_config(path: Path, cluster_id: str, instances: Sequence[dict[str, Any]],
                 sections: dict[str, dict[str, Any]], **cluster: Any) -> Path:
    """`cluster`: further keys of the cluster section (prefill_groups, ...)."""
    data: dict[str, Any] = {"cluster": {"id": cluster_id, "instances": list(instances), **cluster}, **sections}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


class ClusterProcess:
    """Owns one `mooncaked --role all` process tree (its own session and process group) and its log file."""

    def __init__(self, config_path: Path, url: str, log_path: Path) -> None:
        self.config_path = config_path
        self.url = url.rstrip("/")
        self.log_path = log_path
        self.process: asyncio.subprocess.Process | None = None

    async def start(self, timeout_s: float) -> None:
        with open(self.log_path, "ab") as log:
            self.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "mooncaked", "--role", "all", "--config", str(self.config_path),
                stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        try:
            await self._wait_healthy(timeout_s)
        except BaseException:
            await self.stop(timeout_s=15.0)
            raise

    async def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                assert self.process is not None
                if self.process.returncode is not None:
                    raise RuntimeError(f"the cluster exited with code {self.process.returncode}:\n{self.log_tail()}")
                if await _is_healthy(session, self.url + "/health"):
                    return
                await asyncio.sleep(0.25)
        raise RuntimeError(f"the cluster did not answer GET /health within {timeout_s:.0f}s:\n{self.log_tail()}")

    async def stop(self, timeout_s: float) -> int | None:
        """SIGTERM, wait up to `timeout_s`, then SIGKILL the group; the supervisor's exit code (None if killed)."""
        process, self.process = self.process, None
        if process is None:
            return None
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                return await asyncio.wait_for(process.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # the group start_new_session made: this tree only
        await process.wait()
        return None

    def log_tail(self, num_chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-num_chars:]
        return ""


async def _is_healthy(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=2.0)) as response:
            return response.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return False
