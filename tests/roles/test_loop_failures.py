"""An unexpected exception in a long-lived loop of a live cluster (store, prefill, decode, conductor; tiny model):
it is logged, and the loop restarts (the conductor's LOAD polling) or its instance is marked failed at once (the
decode loop, the prefill batch loop), so the request gets an answer instead of hanging."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from mooncaked.roles.conductor.view.worker_health import WorkerHealth
from mooncaked.roles.worker.decode import loop as decode_loop
from mooncaked.roles.worker.prefill import role as prefill_role
from mooncaked.rpc import HEALTH, HealthRequest, RpcClient
from tests.roles.test_conductor_flow import GREEDY, make_config, prompt, running_roles, url

BODY = {"prompt": prompt(11, 40), "max_tokens": 4, **GREEDY}


def failing_once(function: Any, error: Exception) -> Any:
    calls: list[int] = []

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise error
        return function(*args, **kwargs)

    return wrapper


async def status_of(http: aiohttp.ClientSession, route: str) -> int:
    async with http.post(route, json=BODY) as response:
        await response.read()
        return response.status


async def is_healthy(config: Any, name: str) -> bool:
    instance = config.instance_named(name)
    client = RpcClient(f"tcp://{instance.host}:{instance.port}", role="test", instance="test",
                       cluster_id=config.cluster.id, secret=None)
    try:
        reply = await client.call(HEALTH, HealthRequest(), timeout_s=5)
        return bool(reply.is_healthy)
    finally:
        await client.close()


@pytest.mark.parametrize(("name", "module", "function"), [
    ("d0", decode_loop, "finish_reason_for"),  # outside the step's own error handling
    ("p0", prefill_role, "take_batch"),
])
async def test_a_failed_worker_loop_marks_its_instance_failed_and_the_request_is_answered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, name: str, module: Any,
        function: str) -> None:
    monkeypatch.setattr(module, function, failing_once(getattr(module, function), RuntimeError("injected")))
    config = make_config(tmp_path)
    async with running_roles(config, ["s0", "p0", "d0", "c0"]) as roles, aiohttp.ClientSession() as http:
        status = await asyncio.wait_for(status_of(http, url(config, "/v1/completions")), 30)
        assert status in (200, 503)  # answered (migrated, or no instance left), never hung
        assert roles[name].failed.is_set()  # type: ignore[attr-defined]
        assert not await is_healthy(config, name)
    loop_name = "decode-loop" if name == "d0" else "prefill-batch-loop"
    assert f"background loop {loop_name} failed: RuntimeError: injected; the instance is marked failed" in caplog.text


async def test_load_polling_survives_an_unexpected_exception(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(WorkerHealth, "loaded", failing_once(WorkerHealth.loaded, ValueError("injected")))
    config = make_config(tmp_path, conductor={"load_poll_interval_s": 0.05})
    async with running_roles(config, ["s0", "p0", "d0", "c0"]), aiohttp.ClientSession() as http:
        status = await asyncio.wait_for(status_of(http, url(config, "/v1/completions")), 30)
        assert status == 200
    assert "background loop load-" in caplog.text and "ValueError: injected; restarting it" in caplog.text
