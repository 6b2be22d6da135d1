"""A prefill group failing: a stage process killed mid-prompt, a stage failing a chunk, hostile stage requests.

Every case must end the PREFILL with a clear error naming the stage, within the deadline, leaving no pages, no
store handles, no read leases and no open stage job behind, and the group must serve the next prompt."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mooncaked.config import Config
from mooncaked.roles.base import PeerClients
from mooncaked.roles.worker.group import head as cpp_head
from mooncaked.roles.worker.group import stage as cpp_stage
from mooncaked.roles.worker.group.messages import CPP_CHUNK, CPP_STAGE, ChunkRequest, StageRequest
from mooncaked.roles.worker.kv.spans import StoreBlocks
from mooncaked.roles.worker.messages import SamplingSpec
from mooncaked.roles.worker.prefill.role import PrefillRole
from mooncaked.rpc import HEALTH, HealthRequest, InvalidArgument, ResourceExhausted, RpcError, Unavailable
from mooncaked.runtime.lifecycle import Role
from mooncaked.store import messages as store_messages
from tests.roles.cluster_fixtures import running_roles
from tests.roles.worker.group.test_pipeline import group_config, prefill, prompt

GREEDY = SamplingSpec(max_tokens=1, temperature=0.0, ignore_eos=True)


async def store_counters(clients: PeerClients, config: Config, store: str) -> dict[str, int]:
    reply = await clients.for_instance(config.instance_named(store)).call(
        store_messages.STATS, store_messages.StatsRequest(), timeout_s=5)
    return dict(reply.counters)


def assert_released(role: Role) -> None:
    assert isinstance(role, PrefillRole)
    pages = role.worker.pages
    assert pages is not None and pages.num_free == pages.num_pages
    assert role.is_idle


async def until_healthy(clients: PeerClients, config: Config, name: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    client = clients.for_instance(config.instance_named(name))
    while True:
        try:
            await client.call(HEALTH, HealthRequest(), timeout_s=1.0)
            return
        except RpcError:
            assert time.monotonic() < deadline, f"{name} did not come up"
            await asyncio.sleep(0.1)


async def test_a_stage_killed_mid_prompt_fails_the_prefill_cleanly(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    config = group_config(tmp_path, 16)
    reached, resume = threading.Event(), threading.Event()
    run_chunk = cpp_head.run_chunk
    num_calls = [0]

    def gated(worker: Any, plan: Any, chunk: Any, hidden_in: Any, **kwargs: Any) -> Any:
        num_calls[0] += 1
        if num_calls[0] == 3:  # chunks 0 and 1 went to g1; chunk 2 waits until g1 is dead
            reached.set()
            assert resume.wait(30.0), "the test never resumed the first stage"
        return run_chunk(worker, plan, chunk, hidden_in, **kwargs)

    monkeypatch.setattr(cpp_head, "run_chunk", gated)
    stage1 = subprocess.Popen([sys.executable, "-m", "mooncaked", "--role", "prefill", "--config",
                               str(tmp_path / "cluster.yaml"), "--instance", "g1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        async with running_roles(config, ["s1", "g0"]) as roles:
            clients = PeerClients(config, config.instance_named("g0"))
            try:
                await until_healthy(clients, config, "g1")
                tokens = prompt(9, 160)
                started = time.monotonic()
                call = asyncio.ensure_future(prefill(clients, config, "g0", "doomed", tokens))
                assert await asyncio.to_thread(reached.wait, 30.0)
                os.kill(stage1.pid, signal.SIGKILL)
                stage1.wait(10)
                resume.set()
                with pytest.raises(Unavailable, match=r"stage 1 \(g1\) failed"):
                    await asyncio.wait_for(call, 30.0)
                assert time.monotonic() - started < 30.0
                assert_released(roles["g0"])
                counters = await store_counters(clients, config, "s1")
                assert counters["num_pending"] == 0 and counters["num_read_leases"] == 0
                assert counters["num_blocks"] == 0 and counters["used_bytes"] == 0
            finally:
                await clients.close()
    finally:
        resume.set()
        if stage1.poll() is None:
            stage1.kill()
        stage1.wait(10)


async def test_a_stage_failing_a_chunk_fails_the_prefill_and_the_group_recovers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = group_config(tmp_path, 16)
    run_chunk = cpp_stage.run_chunk
    failures = [1]

    def failing(worker: Any, job: Any, chunk: Any, hidden_in: Any, **kwargs: Any) -> Any:
        if failures[0] and chunk.num_cached_tokens == 32:
            failures[0] -= 1
            raise RuntimeError("injected stage failure")
        return run_chunk(worker, job, chunk, hidden_in, **kwargs)

    monkeypatch.setattr(cpp_stage, "run_chunk", failing)
    async with running_roles(config, ["s1", "g0", "g1"]) as roles:
        clients = PeerClients(config, config.instance_named("g0"))
        try:
            tokens = prompt(4, 100)
            with pytest.raises(Unavailable, match=r"stage 1 \(g1\) failed.*chunk 2 failed"):
                await asyncio.wait_for(prefill(clients, config, "g0", "r1", tokens), 30.0)
            assert_released(roles["g0"])
            assert_released(roles["g1"])
            counters = await store_counters(clients, config, "s1")
            assert counters["num_pending"] == 0 and counters["num_blocks"] == 0
            again = await prefill(clients, config, "g0", "r2", tokens)  # the group serves the next prompt
            assert again.num_cached_tokens == 0
            assert (await store_counters(clients, config, "s1"))["num_blocks"] == 6
        finally:
            await clients.close()


def _stage_requests() -> st.SearchStrategy[StageRequest]:
    spans = st.builds(StoreBlocks, st.sampled_from(["s1", "s2", "nope", ""]),
                      st.lists(st.integers(-3, 40), max_size=4), st.lists(st.integers(-1, 1 << 40), max_size=4))
    return st.builds(
        StageRequest, st.text(max_size=8), st.sampled_from(["pg", "other"]), st.integers(-1, 3),
        st.integers(-1, 3), st.integers(-1, 3), st.integers(-5, 5000), st.integers(-2, 40), st.integers(-1, 200),
        st.builds(SamplingSpec, st.integers(-1, 4), st.floats(-1, 3), st.floats(-0.5, 2), st.integers(-2, 5)),
        st.lists(spans, max_size=2), st.lists(spans, max_size=2))


async def test_hostile_stage_requests_are_refused_and_leave_nothing(tmp_path: Path) -> None:
    config = group_config(tmp_path, 16)
    async with running_roles(config, ["s1", "s2", "g0", "g1"]) as roles:
        clients = PeerClients(config, config.instance_named("g0"))
        stage = clients.for_instance(config.instance_named("g1"))
        stage1 = roles["g1"]
        loop = asyncio.get_running_loop()

        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
        @given(_stage_requests())
        def check(request: StageRequest) -> None:
            asyncio.run_coroutine_threadsafe(_check_one(stage, request), loop).result(30)

        async def _check_one(client: Any, request: StageRequest) -> None:
            try:
                async for item in client.stream(CPP_STAGE, request, timeout_s=0.5):
                    assert not item.is_done  # a valid open: no chunk ever comes, so it ends by its deadline
            except (InvalidArgument, ResourceExhausted) as exc:
                assert exc.message
            except RpcError as exc:  # an accepted one that ran into its deadline
                assert "deadline" in exc.message or "not computed" in exc.message, exc
            for _ in range(200):
                if stage1.is_idle:  # type: ignore[attr-defined]
                    break
                await asyncio.sleep(0.01)
            assert_released(stage1)

        try:
            await asyncio.to_thread(check)
            with pytest.raises(Unavailable, match="not open"):
                await stage.call(CPP_CHUNK, ChunkRequest("ghost", 0, "127.0.0.1:1", "x", 0, 16), timeout_s=5)
            counters = await store_counters(clients, config, "s1")
            assert counters["num_pending"] == 0 and counters["num_read_leases"] == 0
        finally:
            await clients.close()

