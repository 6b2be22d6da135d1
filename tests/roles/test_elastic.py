"""An elastic cluster on a real etcd (in-process roles, tiny random model, loopback): each instance's config
describes only itself; joins, drains and leaves, two conductors racing for one decode instance, role switches
under load, and an etcd outage under load."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from mooncaked.bench.etcd_server import EtcdServer
from mooncaked.config import load_config
from mooncaked.roles import make_role
from mooncaked.roles.base import PeerClients
from mooncaked.roles.conductor.role import ConductorRole
from mooncaked.roles.member import MemberRole
from mooncaked.roles.worker.switch_messages import SWITCH, SwitchRequest
from mooncaked.roles.worker.switching import SwitchableWorkerRole
from mooncaked.runtime.lifecycle import Role
from tests.cluster.etcd_fixture import etcd, needs_etcd  # noqa: F401
from tests.roles.cluster_fixtures import instance

pytestmark = needs_etcd


def own_config(tmp_path: Path, server: EtcdServer, entry: dict[str, Any], **sections: dict[str, Any]) -> Any:
    """A config that names only this instance, plus the etcd endpoints."""
    data: dict[str, Any] = {
        "cluster": {"id": "elastic", "membership": "etcd", "instances": [entry],
                    "etcd": {"endpoints": [server.endpoint], "lease_ttl_s": 2, "call_timeout_s": 1.0,
                             "min_backoff_s": 0.05, "max_backoff_s": 0.5, "drain_notice_s": 0.5}},
        "model": {"source": "random:tiny", "name": "tiny", "max_model_len": 512},
        "kv": {"block_size": 16},
        "runtime": {"drain_timeout_s": 2.0},
        "store": {"dram_bytes": 32 << 20, "shm_dir": str(tmp_path), "maintenance_interval_s": 0.05},
        "worker": {"num_kv_pages": 128, "prefill_chunk": 64, "max_batch_tokens": 256, "abort_grace_s": 0.5,
                   "inline_prefill_max_tokens": 0},
        "conductor": {"load_poll_interval_s": 0.05},
        "pd_controller": {"enabled": False},
    }
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    path = tmp_path / f"{entry['name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


class Fleet:
    """Owns the roles a test started; stops them in reverse order."""

    def __init__(self, tmp_path: Path, server: EtcdServer) -> None:
        self.tmp_path, self.server = tmp_path, server
        self.roles: dict[str, Role] = {}
        self.ports: dict[str, int] = {}

    async def add(self, name: str, role: str, **sections: dict[str, Any]) -> Role:
        entry = instance(name, role)
        config = own_config(self.tmp_path, self.server, entry, **sections)
        started = make_role(config, config.instance_named(name))
        assert isinstance(started, MemberRole)
        await started.start()
        self.roles[name], self.ports[name] = started, entry["port"]
        return started

    async def remove(self, name: str) -> None:
        await self.roles.pop(name).stop()

    def inner(self, name: str) -> Any:
        role = self.roles[name]
        assert isinstance(role, MemberRole)
        return role.inner

    async def stop(self) -> None:
        for name in reversed(list(self.roles)):
            await self.remove(name)


@contextlib.asynccontextmanager
async def fleet(tmp_path: Path, server: EtcdServer) -> AsyncIterator[Fleet]:
    started = Fleet(tmp_path, server)
    try:
        yield started
    finally:
        await started.stop()


async def wait_until(condition: Callable[[], Any], timeout_s: float, what: str) -> float:
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - started


async def complete(session: aiohttp.ClientSession, port: int, seed: int, num_tokens: int = 40,
                   max_tokens: int = 4) -> tuple[int, dict[str, Any]]:
    rng = random.Random(seed)
    body = {"model": "tiny", "prompt": [rng.randrange(3, 300) for _ in range(num_tokens)], "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True}
    async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body,
                            timeout=aiohttp.ClientTimeout(total=30)) as response:
        return response.status, await response.json()


async def test_join_drain_and_leave_without_editing_configs(tmp_path: Path, etcd: EtcdServer) -> None:
    async with fleet(tmp_path, etcd) as f, aiohttp.ClientSession() as session:
        await f.add("s0", "store")
        await f.add("c0", "conductor")
        conductor = f.inner("c0")
        assert isinstance(conductor, ConductorRole) and conductor.view is not None
        status, _ = await complete(session, f.ports["c0"], 1)
        assert status == 503  # no decode instance yet
        await f.add("d0", "decode")
        await wait_until(lambda: "d0" in conductor.view.decode and conductor.view.decode["d0"].is_placeable,
                         2.0, "d0 placeable on c0")
        status, body = await complete(session, f.ports["c0"], 2)
        assert status == 200 and body["usage"]["completion_tokens"] == 4
        async with session.get(f"http://127.0.0.1:{f.ports['c0']}/health") as response:
            health = await response.json()
        assert health["membership"]["backend"] == "etcd" and health["membership"]["is_connected"]
        stopping = asyncio.create_task(f.remove("d0"))
        await wait_until(lambda: "d0" not in conductor.view.decode or conductor.view.decode["d0"].state == "draining",
                         2.0, "d0 draining")
        await stopping
        await wait_until(lambda: "d0" not in conductor.view.decode, 2.0, "d0 removed")
        status, _ = await complete(session, f.ports["c0"], 3)
        assert status == 503


async def test_two_conductors_race_for_one_decode_slot(tmp_path: Path, etcd: EtcdServer) -> None:
    async with fleet(tmp_path, etcd) as f, aiohttp.ClientSession() as session:
        await f.add("s0", "store")
        await f.add("d0", "decode", worker={"max_batch_size": 1})
        await f.add("c0", "conductor")
        await f.add("c1", "conductor")
        decode = f.inner("d0")
        peak = 0

        async def watch_batch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, len(decode.loop.running) + len(decode.reservations))
                await asyncio.sleep(0)

        for name in ("c0", "c1"):
            view = f.inner(name).view
            await wait_until(lambda: "d0" in view.decode and view.decode["d0"].is_placeable, 2.0, "d0 placeable")
        watcher = asyncio.create_task(watch_batch())
        try:
            results = await asyncio.gather(*(complete(session, f.ports[("c0", "c1")[i % 2]], i, max_tokens=8)
                                             for i in range(12)))
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        statuses = [status for status, _ in results]
        assert peak == 1, f"the decode instance held {peak} sequences with max_batch_size 1"
        assert set(statuses) <= {200, 429} and statuses.count(200) >= 1, statuses
        assert all(body["error"]["message"] for status, body in results if status == 429)
        for name in ("c0", "c1"):  # both serve once the race is over and their views show it
            view = f.inner(name).view
            await wait_until(lambda: (lambda load: load is not None and not load.num_running + load.num_waiting
                                      and load.num_free_pages == load.num_pages)(view.decode["d0"].load),
                             5.0, "d0 idle")
            status, body = await complete(session, f.ports[name], 99)
            assert status == 200, body


async def test_role_switch_under_load_loses_no_request(tmp_path: Path, etcd: EtcdServer) -> None:
    switchable = {"switchable": True}
    async with fleet(tmp_path, etcd) as f, aiohttp.ClientSession() as session:
        await f.add("s0", "store")
        await f.add("p0", "prefill", worker=switchable)
        await f.add("p1", "prefill", worker=switchable)
        await f.add("d0", "decode")
        await f.add("c0", "conductor")
        view = f.inner("c0").view
        await wait_until(lambda: {"p0", "p1"} <= {n for n, w in view.prefill.items() if w.is_placeable}
                         and "d0" in view.decode, 3.0, "cluster up")
        worker = f.inner("p1")
        assert isinstance(worker, SwitchableWorkerRole)
        pages_before = worker.worker.kv_pages
        stop = asyncio.Event()
        results: list[int] = []

        async def client(seed: int) -> None:
            while not stop.is_set():
                status, body = await complete(session, f.ports["c0"], seed, num_tokens=48, max_tokens=6)
                assert status == 200, body
                results.append(status)
                seed += 100

        clients = [asyncio.create_task(client(i)) for i in range(3)]
        peers = PeerClients(own_config(tmp_path, etcd, instance("x", "conductor")), instance_of("x"))
        try:
            await wait_until(lambda: len(results) >= 3, 20.0, "load flowing")
            rpc = peers.for_instance(view.instance_config("p1"))
            reply = await rpc.call(SWITCH, SwitchRequest("decode", "test", 10.0), timeout_s=20.0)
            assert reply.is_switched and reply.role == "decode" and reply.num_cancelled == 0
            await wait_until(lambda: "p1" in view.decode and view.decode["p1"].is_placeable, 2.0, "p1 is decode")
            num_before = len(results)
            await wait_until(lambda: len(results) >= num_before + 6, 30.0, "load after the switch")
            reply = await rpc.call(SWITCH, SwitchRequest("prefill", "test", 10.0), timeout_s=20.0)
            assert reply.is_switched and reply.num_switches == 2
            await wait_until(lambda: "p1" in view.prefill and view.prefill["p1"].is_placeable, 2.0, "p1 prefill")
            refused = await rpc.call(SWITCH, SwitchRequest("prefill"), timeout_s=5.0)
            assert not refused.is_switched and "already prefill" in refused.reason
        finally:
            stop.set()
            await asyncio.gather(*clients)
            await peers.close()
        assert worker.worker.kv_pages is pages_before  # the same pages (and weights) served both roles
        async with session.get(f"http://127.0.0.1:{f.ports['c0']}/v1/cluster") as response:
            info = await response.json()
        assert {i["name"]: i["role"] for i in info["instances"]}["p1"] == "prefill"


def instance_of(name: str) -> Any:
    from mooncaked.config import InstanceConfig

    return InstanceConfig(name, "conductor")


async def test_etcd_outage_under_load(tmp_path: Path, etcd: EtcdServer) -> None:
    async with fleet(tmp_path, etcd) as f, aiohttp.ClientSession() as session:
        await f.add("s0", "store")
        await f.add("d0", "decode")
        await f.add("c0", "conductor")
        conductor = f.inner("c0")
        await wait_until(lambda: "d0" in conductor.view.decode and conductor.view.decode["d0"].is_placeable,
                         2.0, "d0 placeable")
        await etcd.stop()
        await wait_until(lambda: not conductor.membership.status().is_connected, 5.0, "outage seen")
        statuses = [(await complete(session, f.ports["c0"], i))[0] for i in range(4)]
        assert statuses == [200] * 4  # serving with the membership last seen
        async with session.get(f"http://127.0.0.1:{f.ports['c0']}/health") as response:
            health = await response.json()
        assert response.status == 200 and not health["membership"]["is_connected"]
        assert "etcd unreachable" in health["membership"]["last_error"]
        await etcd.start()
        await wait_until(lambda: conductor.membership.status().is_connected, 5.0, "reconnected")
        await wait_until(lambda: conductor.view.decode["d0"].is_placeable, 3.0, "d0 still placeable")
        assert (await complete(session, f.ports["c0"], 9))[0] == 200
