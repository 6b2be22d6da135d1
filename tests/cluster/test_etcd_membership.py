"""Membership against a real etcd on loopback: the client, joins and leaves, lease expiry, outages, elections."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from mooncaked.bench.etcd_server import EtcdServer
from mooncaked.cluster.etcd_client import EtcdClient, EtcdError, EtcdUnavailable
from mooncaked.cluster.etcd_membership import EtcdMembership
from mooncaked.config import Config, load_config
from tests.cluster.etcd_fixture import etcd, needs_etcd  # noqa: F401

pytestmark = needs_etcd


def etcd_config(tmp_path: Path, server: EtcdServer, *instances: tuple[str, str], ttl: int = 2) -> Config:
    import yaml

    entries = [{"name": n, "role": r, "host": "127.0.0.1", "port": 7000 + i} for i, (n, r) in enumerate(instances)]
    data = {"cluster": {"id": "t", "membership": "etcd", "instances": entries,
                        "etcd": {"endpoints": [server.endpoint], "lease_ttl_s": ttl, "call_timeout_s": 1.0,
                                 "min_backoff_s": 0.05, "max_backoff_s": 0.3, "watch_renew_s": 2.0}}}
    path = tmp_path / "etcd.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


async def wait_until(condition: Callable[[], Any], timeout_s: float, what: str) -> float:
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - started


@contextlib.asynccontextmanager
async def two_candidates(tmp_path: Path, server: EtcdServer) -> AsyncIterator[tuple[Config, EtcdMembership,
                                                                                  EtcdMembership]]:
    """Conductors c0 and c1 (lease TTL 1 s), both campaigning, c0 first: (config, c0, c1); both stopped after."""
    config = etcd_config(tmp_path, server, ("c0", "conductor"), ("c1", "conductor"), ttl=1)
    first, second = (EtcdMembership(config, config.instance_named(n)) for n in ("c0", "c1"))
    await first.start()
    await first.campaign()
    await second.start()
    await second.campaign()
    try:
        yield config, first, second
    finally:
        await first.stop()
        await second.stop()


async def crash(membership: EtcdMembership) -> None:
    """What kill -9 leaves behind: no more keep-alives, no revoke."""
    assert membership._task is not None
    membership._task.cancel()
    await asyncio.gather(membership._task, return_exceptions=True)
    membership._task = None
    membership.lease_id = 0
    await membership.client.close()


async def test_client_keys_leases_and_watch(etcd: EtcdServer) -> None:
    client = EtcdClient([etcd.endpoint], 2.0)
    try:
        lease = await client.grant(5)
        assert await client.keepalive(lease) > 0
        assert await client.put_if_absent(b"/p/a", b"1", lease)
        assert not await client.put_if_absent(b"/p/a", b"2", lease)
        revision = await client.put(b"/p/b", b"2")
        kvs, at = await client.get_prefix(b"/p/")
        assert [(kv.key, kv.value) for kv in kvs] == [(b"/p/a", b"1"), (b"/p/b", b"2")] and at == revision
        assert kvs[0].lease == lease and kvs[1].lease == 0
        events = client.watch_prefix(b"/p/", revision + 1, idle_s=5.0)
        await client.revoke(lease)
        await client.revoke(lease)  # already gone: no error
        batch = await anext(events)
        assert [(e.kind, e.kv.key) for e in batch] == [("delete", b"/p/a")]
        await events.aclose()
        assert await client.keepalive(lease) == 0
        assert await client.delete(b"/p/b") == 1
        with pytest.raises(EtcdError, match="lease"):
            await client.put(b"/p/c", b"", lease)
    finally:
        await client.close()


async def test_unreachable_endpoints_fail_within_the_deadline() -> None:
    from mooncaked.bench.cluster import free_port

    client = EtcdClient([f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"], 0.5)
    started = time.monotonic()
    with pytest.raises(EtcdUnavailable, match="etcd unreachable"):
        await client.grant(5)
    assert time.monotonic() - started < 2.0
    await client.close()


async def test_join_drain_and_clean_leave(tmp_path: Path, etcd: EtcdServer) -> None:
    config = etcd_config(tmp_path, etcd, ("c0", "conductor"), ("d0", "decode"))
    watcher = EtcdMembership(config, config.instance_named("c0"))
    joined = EtcdMembership(config, config.instance_named("d0"))
    seen: list[tuple[str, str | None]] = []
    watcher.add_listener(lambda n, old, new: seen.append((n, new.state if new else None)))
    await watcher.start()
    try:
        assert watcher.status().is_connected and set(watcher.members()) == {"c0"}
        await joined.start()
        await wait_until(lambda: "d0" in watcher.members(), 2.0, "d0 visible")
        assert watcher.members()["d0"].state == "starting"
        await joined.set_state("ready")
        await joined.set_state("draining")
        await wait_until(lambda: watcher.members()["d0"].state == "draining", 2.0, "d0 draining")
        await joined.stop()
        await wait_until(lambda: "d0" not in watcher.members(), 1.0, "d0 gone at once")
        assert [s for n, s in seen if n == "d0"] == ["starting", "ready", "draining", None]
    finally:
        await joined.stop()
        await watcher.stop()


async def test_a_crashed_instance_goes_when_its_lease_expires(tmp_path: Path, etcd: EtcdServer) -> None:
    config = etcd_config(tmp_path, etcd, ("c0", "conductor"), ("s0", "store"), ttl=1)
    watcher, victim = EtcdMembership(config, None), EtcdMembership(config, config.instance_named("s0"))
    await watcher.start()
    await victim.start()
    try:
        await wait_until(lambda: "s0" in watcher.members(), 2.0, "s0 visible")
        await crash(victim)
        elapsed = await wait_until(lambda: "s0" not in watcher.members(), 5.0, "s0 removed by lease expiry")
        assert elapsed >= 0.5  # removed by the lease, not by a revoke
    finally:
        await victim.stop()
        await watcher.stop()


async def test_etcd_outage_keeps_membership_and_recovers(tmp_path: Path, etcd: EtcdServer) -> None:
    config = etcd_config(tmp_path, etcd, ("c0", "conductor"), ("d0", "decode"), ("d1", "decode"), ttl=2)
    watcher = EtcdMembership(config, config.instance_named("c0"))
    survivor, victim = (EtcdMembership(config, config.instance_named(n)) for n in ("d0", "d1"))
    for m in (watcher, survivor, victim):
        await m.start()
    try:
        await wait_until(lambda: set(watcher.members()) == {"c0", "d0", "d1"}, 2.0, "all visible")
        await etcd.stop()
        await wait_until(lambda: not watcher.status().is_connected, 5.0, "outage noticed")
        status = watcher.status()
        assert "etcd unreachable" in status.last_error and status.num_members == 3
        await crash(victim)  # dies during the outage: nobody can tell until etcd is back
        await asyncio.sleep(config.cluster.etcd.lease_ttl_s + 0.5)  # the outage outlasts every lease
        assert set(watcher.members()) == {"c0", "d0", "d1"}
        await etcd.start()
        await wait_until(lambda: watcher.status().is_connected and survivor.status().is_connected, 5.0, "back")
        await wait_until(lambda: set(watcher.members()) == {"c0", "d0"}, 6.0, "the dead one removed, others kept")
        assert watcher.status().disconnected_for_s == 0.0
    finally:
        for m in (victim, survivor, watcher):
            await m.stop()


async def test_election_and_takeover(tmp_path: Path, etcd: EtcdServer) -> None:
    async with two_candidates(tmp_path, etcd) as (config, first, second):
        await wait_until(lambda: second.leader() == "c0" and first.is_leader(), 2.0, "c0 leads")
        assert not second.is_leader()
        changed = second.leader_changed()
        await crash(first)
        elapsed = await wait_until(second.is_leader, 4.0, "c1 takes over")
        assert changed.is_set() and elapsed <= config.cluster.etcd.lease_ttl_s + 2.0


async def test_a_leader_cut_off_from_etcd_steps_down_before_another_takes_over(
        tmp_path: Path, etcd: EtcdServer) -> None:
    """c0's keep-alives and watch events stop getting through (a cut link: no call fails before its timeout, here
    never): c0 stops leading once its lease may have expired, before c1 can lead: never two leaders at once."""
    async with two_candidates(tmp_path, etcd) as (config, first, second):
        await wait_until(lambda: first.is_leader() and second.leader() == "c0", 2.0, "c0 leads")

        async def unanswered(lease_id: int) -> int:
            await asyncio.sleep(60.0)
            return 0

        first.client.keepalive = unanswered  # type: ignore[method-assign]
        first._apply = lambda event: None  # type: ignore[method-assign]
        deadline = time.monotonic() + 6.0
        while not second.is_leader():
            assert not first.is_leader() or not second.is_leader()
            assert time.monotonic() < deadline, "c1 never took over"
            await asyncio.sleep(0.01)
        assert not first.is_leader()


async def test_an_unexpected_session_failure_steps_down_and_registers_again(
        tmp_path: Path, etcd: EtcdServer, caplog: pytest.LogCaptureFixture) -> None:
    async with two_candidates(tmp_path, etcd) as (config, first, second):
        await wait_until(lambda: first.is_leader() and second.leader() == "c0", 2.0, "c0 leads")
        keepalive, calls = first.client.keepalive, []
        old_lease = first.lease_id

        async def keepalive_failing_once(lease_id: int) -> int:
            calls.append(lease_id)
            if len(calls) == 1:
                raise TypeError("injected: not an EtcdError")
            return await keepalive(lease_id)

        first.client.keepalive = keepalive_failing_once  # type: ignore[method-assign]
        await wait_until(lambda: calls, 2.0, "the next keep-alive")
        await wait_until(lambda: not first.is_leader(), 0.2, "a failed session is a lost lease: c0 steps down")
        await wait_until(lambda: first.status().is_connected and first.lease_id not in (0, old_lease), 5.0,
                         "c0 registered again on a fresh lease")
        await wait_until(second.is_leader, 4.0, "c1 leads: c0's old candidacy went with its old lease")
        await asyncio.sleep(config.cluster.etcd.lease_ttl_s + 0.5)
        assert second.is_leader() and not first.is_leader(), "never two leaders"
        assert set(second.members()) == {"c0", "c1"}
        assert "etcd session failed unexpectedly" in caplog.text and "injected: not an EtcdError" in caplog.text
