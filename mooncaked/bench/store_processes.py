"""Instances as their own processes for a benchmark: stores beside a worker in the benchmark's process, or
whole clusters of workers (bench cpp).

A store in the worker's process would share its interpreter lock: the store's side of every transfer would
then compete with the forward for it, a cost no deployment pays (a store is its own process, usually on
another host).

1. `async with instance_processes(config_path, config, names, log_path, timeout_s)`: start
   `python -m mooncaked --role ROLE --instance NAME` for each name, in order (each pins itself to its
   instance's `cpus`), then wait until every one answers HEALTH over RPC (a worker does once it has loaded
   and profiled itself). `store_processes` is the same for stores.
2. On exit: SIGTERM each, wait up to the deadline, then SIGKILL the process group it was started in.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from mooncaked.config import Config, InstanceConfig
from mooncaked.roles.base import PeerClients
from mooncaked.rpc import HEALTH, HealthRequest, RpcError

STOP_TIMEOUT_S = 15.0


@contextlib.asynccontextmanager
async def store_processes(config_path: Path, config: Config, names: Sequence[str], log_path: Path,
                          timeout_s: float) -> AsyncIterator[None]:
    async with instance_processes(config_path, config, names, log_path, timeout_s):
        yield


@contextlib.asynccontextmanager
async def instance_processes(config_path: Path, config: Config, names: Sequence[str], log_path: Path,
                             timeout_s: float) -> AsyncIterator[None]:
    processes: list[asyncio.subprocess.Process] = []
    try:
        with open(log_path, "ab") as log:
            for name in names:
                role = config.instance_named(name).role
                processes.append(await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "mooncaked", "--role", role, "--config", str(config_path),
                    "--instance", name, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log,
                    start_new_session=True))
        await _wait_healthy(config, names, processes, log_path, timeout_s)
        yield
    finally:
        for process in processes:
            await _stop(process)


async def _wait_healthy(config: Config, names: Sequence[str], processes: Sequence[asyncio.subprocess.Process],
                        log_path: Path, timeout_s: float) -> None:
    clients = PeerClients(config, InstanceConfig(name="bench", role="conductor"))
    deadline = time.monotonic() + timeout_s
    try:
        for name, process in zip(names, processes):
            while not await _is_healthy(clients, config.instance_named(name)):
                if process.returncode is not None or time.monotonic() > deadline:
                    tail = log_path.read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"instance {name} did not start within {timeout_s:g}s:\n{tail}")
                await asyncio.sleep(0.2)
    finally:
        await clients.close()


async def _is_healthy(clients: PeerClients, instance: InstanceConfig) -> bool:
    try:
        reply = await clients.for_instance(instance).call(HEALTH, HealthRequest(), timeout_s=1.0)
    except (RpcError, OSError, asyncio.TimeoutError):
        return False
    return bool(reply.is_healthy)


async def _stop(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(process.wait(), STOP_TIMEOUT_S)
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # the group start_new_session made: this store only
        await process.wait()
