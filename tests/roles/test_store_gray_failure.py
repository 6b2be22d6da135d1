"""A store SIGSTOPped during a KV load (a gray failure: its sockets stay open, nothing answers). The load fails
within its deadlines with an error that says so, no block of it is committed as complete, and the prompt is
served by recomputing it.

Loopback suffices: a stopped process keeps its listening and connected sockets, so the peer sees exactly what a
gray failure on a real link shows (accepted connections, no bytes); a network namespace would add nothing."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from mooncaked.config import Config
from mooncaked.model.loader import load_model
from mooncaked.roles.conductor.role import ConductorRole
from mooncaked.roles.base import PeerClients
from mooncaked.roles.worker.kv import plan as kv_plan
from mooncaked.roles.worker.messages import PREFILL, PrefillRequest, SamplingSpec
from mooncaked.rpc import RpcClient, RpcError
from tests.roles.cluster_fixtures import cluster_config, instance, running_roles
from tests.roles.engine_reference import greedy_tokens
from tests.roles.test_conductor_flow import GREEDY, completion, eventually, expected_text, prompt
from tests.roles.test_disagg_roles import generate, keys_for
from tests.roles.test_failover import WORKER, metric

DEADLINES = {"io_timeout_s": 1.0, "timeout_s": 3.0}


def start_store_process(config: Config, config_path: Path, name: str) -> subprocess.Popen[bytes]:
    """The store in a process of its own, once its RPC port accepts connections (within 30 s)."""
    process = subprocess.Popen([sys.executable, "-m", "mooncaked", "--role", "store", "--config",
                                str(config_path), "--instance", name],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    store = config.instance_named(name)
    deadline = time.monotonic() + 30.0
    while True:
        try:
            socket.create_connection((store.host, store.port), timeout=0.2).close()
            return process
        except OSError:
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                raise
            time.sleep(0.05)


async def test_a_store_stopped_during_a_prefix_load_fails_the_load_in_time_and_commits_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = cluster_config(tmp_path, [
        instance("s2", "store", "127.0.0.2"), instance("p0", "prefill", "127.0.0.2"),
        instance("s3", "store", "127.0.0.3"), instance("d0", "decode", "127.0.0.3"),
        instance("s4", "store", "127.0.0.4"), instance("p4", "prefill", "127.0.0.4"),
    ], transfer=DEADLINES, worker={"kv_load_timeout_s": 3.0}, rpc={"call_timeout_s": 3.0})
    tokens = [random.Random(29).randrange(3, 300) for _ in range(80)]
    expected = greedy_tokens(load_model("random:tiny"), tokens, 1)
    s2 = start_store_process(config, tmp_path / "cluster.yaml", "s2")
    lookup_remote = kv_plan._lookup_remote

    async def stop_s2_after_lookup(*args: Any) -> Any:
        found = await lookup_remote(*args)
        os.kill(s2.pid, signal.SIGSTOP)  # leased, not copied yet: the copy meets a stopped store
        return found

    try:
        async with running_roles(config, ["s3", "s4", "p0", "d0", "p4"]):
            clients = PeerClients(config, config.instance_named("p0"))
            try:
                out, _ = await generate(config, clients, "r1", tokens, 1)  # s2 now holds the prompt's 4 blocks
                assert out == expected
                prefill4: RpcClient = clients.for_instance(config.instance_named("p4"))
                keys = keys_for(config, tokens)
                spec = SamplingSpec(max_tokens=1, temperature=0.0)
                monkeypatch.setattr(kv_plan, "_lookup_remote", stop_s2_after_lookup)
                started = time.monotonic()
                with pytest.raises(RpcError) as failed:
                    await prefill4.call(PREFILL, PrefillRequest("r2", tokens, keys, spec, fetch_store="s2",
                                                                num_fetch_blocks=len(keys)), timeout_s=30)
                elapsed_s = time.monotonic() - started
                assert failed.value.message.startswith("kv_load_failed: ") and "from store s2" in failed.value.message
                assert elapsed_s < 8.0, f"{elapsed_s:.1f}s: past io_timeout_s and kv_load_timeout_s"
                monkeypatch.undo()
                recomputed = await prefill4.call(PREFILL, PrefillRequest("r3", tokens, keys, spec), timeout_s=30)
                assert recomputed.num_cached_tokens == 0  # s4 committed none of the blocks the failed load copied
                assert recomputed.first_token.token_id == expected[0]
            finally:
                await clients.close()
    finally:
        s2.kill()  # SIGKILL ends a stopped process too
        s2.wait(timeout=10)


async def test_a_request_whose_prefix_source_store_stops_is_recomputed_in_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The conductor places prompts on p4 with their prefix fetched from s2. The first fetch measures the link
    (the conductor's transfer estimate then uses it). s2 stops during the second's load: the prefill leg fails
    with kv_load_failed, the request migrates (cause prefill_source) without s2's blocks, p4 computes the
    prompt, and the client gets the text an undisturbed run gives, well within the request's deadlines."""
    config = cluster_config(tmp_path, [
        instance("s2", "store", "127.0.0.2"), instance("p2", "prefill", "127.0.0.2"),
        instance("s3", "store", "127.0.0.3"), instance("d0", "decode", "127.0.0.3"),
        instance("s4", "store", "127.0.0.4"), instance("p4", "prefill", "127.0.0.4"),
        instance("c0", "conductor"),
    ], transfer=DEADLINES, worker={**WORKER, "kv_load_timeout_s": 3.0}, rpc={"connect_timeout_s": 0.5},
        conductor={"prefill_timeout_s": 20.0},
        # a configured link (125 kB/s) slower than loopback measures: the measured link is no slow one, so the
        # second prompt is fetched as line 5 says, not recomputed (sched/prefix_plans.py)
        scheduler={"link_gbps": 0.001})
    prompts = [prompt(seed, 80) for seed in (29, 30)]
    bodies = [{"prompt": tokens, "max_tokens": 4, **GREEDY} for tokens in prompts]
    texts = [expected_text(tokens, 4)[1] for tokens in prompts]
    s2 = start_store_process(config, tmp_path / "cluster.yaml", "s2")
    lookup_remote = kv_plan._lookup_remote

    async def stop_s2_after_lookup(*args: Any) -> Any:
        found = await lookup_remote(*args)
        os.kill(s2.pid, signal.SIGSTOP)
        return found

    try:
        async with running_roles(config, ["s3", "s4", "d0", "c0"]) as roles, aiohttp.ClientSession() as http:
            conductor = roles["c0"]
            assert isinstance(conductor, ConductorRole) and conductor.view is not None
            view = conductor.view
            async with running_roles(config, ["p2"]):  # the only prefill instance: both prompts' blocks go to s2
                await eventually(lambda: view.prefill["p2"].is_up, timeout_s=30.0)
                for body, text in zip(bodies, texts):
                    assert (await completion(http, config, body))["choices"][0]["text"] == text
            async with running_roles(config, ["p4"]):
                await eventually(lambda: view.prefill["p4"].is_up and not view.prefill["p2"].is_up, timeout_s=30.0)
                assert (await completion(http, config, bodies[0]))["choices"][0]["text"] == texts[0]
                ((store, bytes_per_s),) = view.fetch_rates.for_instance("p4")
                assert store == "s2" and bytes_per_s > 0
                monkeypatch.setattr(kv_plan, "_lookup_remote", stop_s2_after_lookup)
                started = time.monotonic()
                done = await completion(http, config, bodies[1])
                elapsed_s = time.monotonic() - started
                assert done["choices"][0]["text"] == texts[1]
                assert elapsed_s < 10.0, f"{elapsed_s:.1f}s"
                assert (await metric(http, config, "mooncaked_migrations_total{")).startswith(
                    'mooncaked_migrations_total{cause="prefill_source"} 1.0')
    finally:
        s2.kill()
        s2.wait(timeout=10)
