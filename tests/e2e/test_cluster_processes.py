"""The product as users run it: `mooncaked --role all` as a process tree, driven over HTTP on loopback.

Tiny random model: a client that disconnects mid-stream returns pages and store leases to their baseline;
killing the decode process mid-stream ends the stream with an error event within the deadline, the
supervisor restarts it and the cluster serves again; SIGTERM stops everything cleanly.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from mooncaked.config import Config, load_config
from mooncaked.roles.base import PeerClients
from mooncaked.roles.worker.messages import LOAD, LoadRequest
from mooncaked.rpc.protocol import INFO, InfoRequest
from mooncaked.store import messages as store_messages
from tests.roles.cluster_fixtures import instance


USABLE_CPUS = sorted(os.sched_getaffinity(0))
PREFILL_CPUS, DECODE_CPUS = USABLE_CPUS[:1], USABLE_CPUS[-1:]


def thread_affinities(pid: int) -> list[set[int]]:
    """The distinct CPU sets of every thread of process pid (torch's, the executor's, the loop's)."""
    distinct: list[set[int]] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            cpus = os.sched_getaffinity(int(task.name))
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        if cpus not in distinct:
            distinct.append(cpus)
    return distinct


def tiny_cluster(tmp_path: Path) -> Path:
    data = {
        "cluster": {"id": "e2e", "instances": [instance("c0", "conductor"), instance("s0", "store"),
                                               instance("p0", "prefill", cpus=PREFILL_CPUS),
                                               instance("d0", "decode", cpus=DECODE_CPUS)]},
        "model": {"source": "random:tiny", "name": "tiny", "max_model_len": 1024},
        "kv": {"block_size": 16},
        "runtime": {"drain_timeout_s": 5.0},
        "store": {"dram_bytes": 16 << 20, "shm_dir": str(tmp_path)},
        "worker": {"num_kv_pages": 256, "inline_prefill_max_tokens": 0},
        "conductor": {"token_timeout_s": 5.0, "first_token_timeout_s": 20.0},
    }
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


class Cluster:
    """A `--role all` process tree and clients to it; the test owns it through `started`."""

    def __init__(self, path: Path, overrides: list[str] = ()) -> None:  # type: ignore[assignment]
        self.config: Config = load_config(path, list(overrides))
        args = [sys.executable, "-m", "mooncaked", "--role", "all", "--config", str(path)]
        for override in overrides:
            args += ["--set", override]
        self.process = subprocess.Popen(args)
        conductor = self.config.instances_of("conductor")[0]
        self.url = f"http://{conductor.host}:{conductor.port}"
        self.peers = PeerClients(self.config, conductor)

    async def wait_healthy(self, session: aiohttp.ClientSession, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, "the cluster exited"
            try:
                async with session.get(f"{self.url}/health") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.3)
        raise AssertionError(f"cluster not healthy within {timeout_s}s")

    def rpc(self, name: str) -> Any:
        return self.peers.for_instance(self.config.instance_named(name))

    async def stop(self) -> int:
        await self.peers.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(None, self.process.wait), 60)
        except asyncio.TimeoutError:
            self.process.kill()
            raise


async def sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    async for raw in response.content:
        line = raw.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: "):])


def completion(prompt: str, max_tokens: int, stream: bool = True) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": stream, "temperature": 0,
            "ignore_eos": True}


async def kv_baseline(cluster: Cluster) -> tuple[int, int, int]:
    load = await cluster.rpc("d0").call(LOAD, LoadRequest(), timeout_s=5)
    stats = await cluster.rpc("s0").call(store_messages.STATS, store_messages.StatsRequest(), timeout_s=5)
    return load.num_free_pages, stats.counters["num_pending"], stats.counters["num_read_leases"]


async def eventually_equal(probe: Any, expected: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while (value := await probe()) != expected:
        assert time.monotonic() < deadline, f"{value} != {expected}"
        await asyncio.sleep(0.2)


async def test_disconnect_kill_decode_restart_and_clean_stop(tmp_path: Path) -> None:
    cluster = Cluster(tiny_cluster(tmp_path))
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            await cluster.wait_healthy(session, 120)
            async with session.post(f"{cluster.url}/v1/completions", json=completion("warm up " * 20, 4)) as r:
                assert r.status == 200 and [e async for e in sse_events(r)]
            baseline = await kv_baseline(cluster)

            async with session.post(f"{cluster.url}/v1/completions", json=completion("goodbye " * 30, 500)) as r:
                num_chunks = 0
                async for _ in sse_events(r):
                    num_chunks += 1
                    if num_chunks == 3:
                        break  # the client goes away mid-stream
            await eventually_equal(lambda: kv_baseline(cluster), baseline, 10)

            decode_pid = (await cluster.rpc("d0").call(INFO, InfoRequest(), timeout_s=5)).pid
            prefill_pid = (await cluster.rpc("p0").call(INFO, InfoRequest(), timeout_s=5)).pid
            assert thread_affinities(decode_pid) == [set(DECODE_CPUS)]
            assert thread_affinities(prefill_pid) == [set(PREFILL_CPUS)]
            started = time.monotonic()
            events: list[dict[str, Any]] = []
            async with session.post(f"{cluster.url}/v1/completions", json=completion("a long one " * 10, 900)) as r:
                async for event in sse_events(r):
                    events.append(event)
                    if len(events) == 3:
                        os.kill(decode_pid, signal.SIGKILL)
            assert "error" in events[-1], events[-1]
            assert time.monotonic() - started < 30

            await cluster.wait_healthy(session, 90)  # the supervisor restarted the decode instance
            restarted_pid = (await cluster.rpc("d0").call(INFO, InfoRequest(), timeout_s=5)).pid
            assert restarted_pid != decode_pid and thread_affinities(restarted_pid) == [set(DECODE_CPUS)]
            async with session.post(f"{cluster.url}/v1/completions", json=completion("again " * 10, 5, False)) as r:
                body = await r.json()
                assert r.status == 200 and body["usage"]["completion_tokens"] == 5, body
    finally:
        assert await cluster.stop() == 0


@pytest.mark.slow
async def test_smollm2_says_paris_through_role_all(tmp_path: Path) -> None:
    """The embedded model behind config.example.yaml (ports moved to free ones)."""
    example = Path(__file__).resolve().parents[2] / "config.example.yaml"
    data = yaml.safe_load(example.read_text())
    for index, entry in enumerate(data["cluster"]["instances"]):
        fresh = instance(entry["name"], entry["role"])
        data["cluster"]["instances"][index] = {**entry, **{k: fresh[k] for k in ("port", "data_port", "rpc_port")
                                                           if k in fresh}}
    data["store"]["shm_dir"] = str(tmp_path)
    data["store"]["dram_bytes"] = 256 << 20
    data["model"]["weight_cache_dir"] = str(tmp_path / "weights")  # not the user's cache
    path = tmp_path / "smollm2.yaml"
    path.write_text(yaml.safe_dump(data))
    cluster = Cluster(path)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            await cluster.wait_healthy(session, 240)
            request = {"model": "smollm2-135m", "max_tokens": 12, "temperature": 0,
                       "messages": [{"role": "user", "content": "What is the capital of France?"}]}
            async with session.post(f"{cluster.url}/v1/chat/completions", json=request) as r:
                body = await r.json()
            assert r.status == 200, body
            assert "Paris" in body["choices"][0]["message"]["content"]
            assert [p.suffix for p in (tmp_path / "weights").glob("*.weights")] == [".weights"]  # one, both workers
    finally:
        assert await cluster.stop() == 0
        shutil.rmtree(tmp_path / "weights", ignore_errors=True)  # 0.65 GB: not left in the test's temp dir
