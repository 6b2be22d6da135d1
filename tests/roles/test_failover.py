"""Failover of every leg: a decode process killed mid-stream, a prefill instance stopped mid-prompt; the client's
stream goes on elsewhere and its text equals an uninterrupted run's."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from mooncaked.config import Config
from mooncaked.roles.conductor.role import ConductorRole
from mooncaked.roles.worker.decode.role import DecodeRole
from mooncaked.roles.worker.prefill import forward as prefill_forward
from mooncaked.roles.worker.prefill.role import PrefillRole
from tests.roles.cluster_fixtures import cluster_config, instance, running_roles
from tests.roles.test_conductor_flow import GREEDY, completion, eventually, expected_text, prompt, url

WORKER = {"inline_prefill_max_tokens": 0, "profile_s": 0}  # unprofiled instances tie: the first one is chosen


def failover_config(tmp_path: Path, names: list[tuple[str, str]]) -> Config:
    return cluster_config(tmp_path, [instance(name, role) for name, role in names], worker=WORKER,
                          conductor={"token_timeout_s": 5.0, "first_token_timeout_s": 20.0},
                          rpc={"connect_timeout_s": 0.5})


async def metric(http: aiohttp.ClientSession, config: Config, line_start: str) -> str:
    async with http.get(url(config, "/metrics")) as response:
        text = await response.text()
    return next((line for line in text.splitlines() if line.startswith(line_start)), "")


def start_decode_process(config_path: Path, name: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "mooncaked", "--role", "decode", "--config", str(config_path),
                             "--instance", name], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def test_a_decode_process_killed_mid_stream_hands_the_stream_to_another(tmp_path: Path) -> None:
    config = failover_config(tmp_path, [("s0", "store"), ("p0", "prefill"), ("d0", "decode"), ("d1", "decode"),
                                        ("c0", "conductor")])
    tokens = prompt(60, 40)
    num_tokens = 300
    _, text = expected_text(tokens, num_tokens)
    async with running_roles(config, ["s0", "p0"]), aiohttp.ClientSession() as http:
        d0 = start_decode_process(tmp_path / "cluster.yaml", "d0")
        try:
            async with running_roles(config, ["d1", "c0"]) as roles:
                conductor = roles["c0"]
                assert isinstance(conductor, ConductorRole) and conductor.view is not None
                view = conductor.view
                await eventually(lambda: view.decode["d0"].is_up and view.decode["d1"].is_up, timeout_s=60.0)
                body = {"prompt": tokens, "max_tokens": num_tokens, "stream": True,
                        "stream_options": {"include_usage": True}, **GREEDY}
                streamed, usage = await stream_killing(http, url(config, "/v1/completions"), body, d0)
                assert streamed == text
                assert usage["completion_tokens"] == num_tokens and usage["prompt_tokens"] == len(tokens)
                assert (await metric(http, config, "mooncaked_migrations_total{")).startswith(
                    'mooncaked_migrations_total{cause="decode_lost"} 1.0')
        finally:
            d0.kill()
            d0.wait(timeout=10)


async def stream_interrupted(http: aiohttp.ClientSession, address: str, body: dict[str, Any],
                             interrupt: Callable[[], Awaitable[None]]) -> tuple[str, dict[str, Any]]:
    """Stream `body`; await `interrupt()` after the third chunk. The streamed text and the usage."""
    texts: list[str] = []
    usage: dict[str, Any] = {}
    async with http.post(address, json=body) as response:
        assert response.status == 200
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            assert "error" not in event, event
            if event.get("choices"):
                texts.append(event["choices"][0]["text"])
                if len(texts) == 3:
                    await interrupt()
            usage = event.get("usage") or usage
    return "".join(texts), usage


async def stream_killing(http: aiohttp.ClientSession, address: str, body: dict[str, Any],
                         victim: subprocess.Popen[bytes]) -> tuple[str, dict[str, Any]]:
    """Stream `body`; kill -9 `victim` after the third chunk. The streamed text and the usage."""
    async def kill() -> None:
        os.kill(victim.pid, signal.SIGKILL)

    streamed = await stream_interrupted(http, address, body, kill)
    assert victim.wait(timeout=10) == -signal.SIGKILL
    return streamed


async def test_a_prefill_instance_stopped_mid_prompt_hands_it_to_another(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = failover_config(tmp_path, [("s0", "store"), ("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"),
                                        ("c0", "conductor")])
    tokens = prompt(61, 70)
    _, text = expected_text(tokens, 8)
    gate = threading.Event()
    load_layer = prefill_forward._load_layer

    def gated_on_p0(plans: Any, layer: int) -> None:
        if plans[0].kv.worker.instance.name == "p0":
            assert gate.wait(timeout=20.0), "the test never released p0"
        load_layer(plans, layer)

    monkeypatch.setattr(prefill_forward, "_load_layer", gated_on_p0)
    async with running_roles(config, ["s0", "p1", "d0"]) as roles, aiohttp.ClientSession() as http:
        async with running_roles(config, ["p0"]) as first:
            p0 = first["p0"]
            assert isinstance(p0, PrefillRole)
            async with running_roles(config, ["c0"]):
                request = asyncio.ensure_future(completion(http, config, {"prompt": tokens, "max_tokens": 8,
                                                                          **GREEDY}))
                await eventually(lambda: bool(p0.running))
                stopping = asyncio.ensure_future(p0.stop())  # drains, then cancels the held prefill
                await eventually(lambda: all(job.plan.is_cancelled for job in p0.running), timeout_s=10.0)
                gate.set()
                done = await asyncio.wait_for(request, 30.0)
                await stopping
                assert done["choices"][0]["text"] == text and done["usage"]["completion_tokens"] == 8
                assert (await metric(http, config, "mooncaked_migrations_total{")).startswith(
                    'mooncaked_migrations_total{cause="prefill_lost"} 1.0')
            first.clear()  # stopped above
        p1 = roles["p1"]
        assert isinstance(p1, PrefillRole) and p1.worker.perf.num_samples()["prefill_live"] == 1


async def test_a_decode_instance_that_stops_decoding_hands_its_streams_on(tmp_path: Path) -> None:
    """A decode loop stopped under a running stream (a role switch's drain deadline, or the role stopping) ends the
    stream with Unavailable, which the conductor migrates like a lost instance."""
    config = failover_config(tmp_path, [("s0", "store"), ("p0", "prefill"), ("d0", "decode"), ("d1", "decode"),
                                        ("c0", "conductor")])
    tokens = prompt(62, 40)
    num_tokens = 200
    _, text = expected_text(tokens, num_tokens)
    async with running_roles(config, ["s0", "p0", "d0", "d1", "c0"]) as roles, aiohttp.ClientSession() as http:
        decodes = [roles["d0"], roles["d1"]]
        body = {"prompt": tokens, "max_tokens": num_tokens, "stream": True, **GREEDY}

        async def stop_the_streaming_instance() -> None:
            # the instance with the lower predicted TBT has it: either of the two, by their fitted step models
            (streaming,) = [role for role in decodes if isinstance(role, DecodeRole) and role.loop.running]
            await streaming.loop.stop()

        streamed, _ = await stream_interrupted(http, url(config, "/v1/completions"), body,
                                               stop_the_streaming_instance)
        assert streamed == text
        assert (await metric(http, config, "mooncaked_migrations_total{")).startswith(
            'mooncaked_migrations_total{cause="decode_lost"} 1.0')


async def test_a_stopped_decode_process_hands_its_stream_on_once_marked_down(tmp_path: Path) -> None:
    """A SIGSTOPped decode instance keeps its sockets open, so no RPC fails: the stream moves when the conductor's
    LOAD poll marks the instance down, not at the (here 60 s) no-token deadline."""
    config = cluster_config(tmp_path, [instance(name, role) for name, role in (
        ("s0", "store"), ("p0", "prefill"), ("d0", "decode"), ("d1", "decode"), ("c0", "conductor"))],
        worker=WORKER, conductor={"token_timeout_s": 60.0, "first_token_timeout_s": 60.0,
                                  "load_poll_interval_s": 0.2, "load_poll_timeout_s": 1.0},
        rpc={"connect_timeout_s": 0.5})
    tokens = prompt(63, 40)
    num_tokens = 200
    _, text = expected_text(tokens, num_tokens)
    async with running_roles(config, ["s0", "p0"]), aiohttp.ClientSession() as http:
        d0 = start_decode_process(tmp_path / "cluster.yaml", "d0")
        try:
            async with running_roles(config, ["d1", "c0"]) as roles:
                conductor = roles["c0"]
                assert isinstance(conductor, ConductorRole) and conductor.view is not None
                view = conductor.view
                await eventually(lambda: view.decode["d0"].is_up and view.decode["d1"].is_up, timeout_s=60.0)
                body = {"prompt": tokens, "max_tokens": num_tokens, "stream": True, **GREEDY}

                async def stop_d0() -> None:
                    os.kill(d0.pid, signal.SIGSTOP)

                started = asyncio.get_running_loop().time()
                streamed, _ = await stream_interrupted(http, url(config, "/v1/completions"), body, stop_d0)
                elapsed_s = asyncio.get_running_loop().time() - started
                assert streamed == text
                assert elapsed_s < 20.0, f"{elapsed_s:.1f}s: the stream waited for the no-token deadline"
                assert (await metric(http, config, "mooncaked_migrations_total{")).startswith(
                    'mooncaked_migrations_total{cause="decode_lost"} 1.0')
        finally:
            d0.kill()  # SIGKILL ends a stopped process too
            d0.wait(timeout=10)
