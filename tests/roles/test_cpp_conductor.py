"""The conductor with a prefill group: long prompts go to the group, a stage killed mid-prompt fails the prefill
leg cleanly (the request moves to the single instance, the client's text is unchanged), and the group takes
nothing until the member is back."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from mooncaked.config import Config
from mooncaked.roles.conductor.role import ConductorRole
from mooncaked.roles.worker.group import head as cpp_head
from mooncaked.roles.worker.prefill.role import PrefillRole
from tests.roles.cluster_fixtures import cluster_config, instance, running_roles
from tests.roles.test_conductor_flow import GREEDY, completion, eventually, expected_text, prompt, url
from tests.roles.test_failover import metric


def group_cluster(tmp_path: Path) -> Config:
    return cluster_config(tmp_path, [
        instance("s0", "store"), instance("g0", "prefill"), instance("g1", "prefill"), instance("p1", "prefill"),
        instance("d0", "decode"), instance("c0", "conductor")],
        cluster={"prefill_groups": [{"name": "pg", "members": ["g0", "g1"]}]},
        worker={"inline_prefill_max_tokens": 0, "profile_s": 0, "cpp_chunk_tokens": 16},
        scheduler={"cpp_min_tokens": 100},
        conductor={"token_timeout_s": 5.0, "first_token_timeout_s": 30.0, "load_poll_interval_s": 0.05},
        rpc={"connect_timeout_s": 0.5})


def start_stage(tmp_path: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "mooncaked", "--role", "prefill", "--config",
                             str(tmp_path / "cluster.yaml"), "--instance", "g1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def live_samples(role: Any) -> int:
    assert isinstance(role, PrefillRole)
    return role.worker.perf.num_samples()["prefill_live"]


async def cluster_info(http: aiohttp.ClientSession, config: Config) -> dict[str, Any]:
    async with http.get(url(config, "/v1/cluster")) as response:
        info: dict[str, Any] = await response.json()
        return info


async def test_a_stage_killed_mid_prompt_moves_the_request_and_parks_the_group(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = group_cluster(tmp_path)
    reached, resume = threading.Event(), threading.Event()
    run_chunk, calls = cpp_head.run_chunk, [0]
    gate_at = [0]  # the chunk (counted over the whole test) that waits for the test

    def gated(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == gate_at[0]:
            reached.set()
            assert resume.wait(30.0), "the test never resumed the first stage"
        return run_chunk(*args, **kwargs)

    monkeypatch.setattr(cpp_head, "run_chunk", gated)
    stage1 = start_stage(tmp_path)
    try:
        async with running_roles(config, ["s0", "g0", "p1", "d0"]) as workers, aiohttp.ClientSession() as http:
            async with running_roles(config, ["c0"]) as conductors:
                conductor = conductors["c0"]
                assert isinstance(conductor, ConductorRole) and conductor.view is not None
                view = conductor.view
                await eventually(lambda: view.is_group_ready("g0"), timeout_s=60.0)
                long_tokens = prompt(31, 150)
                _, long_text = expected_text(long_tokens, 6)
                done = await completion(http, config, {"prompt": long_tokens, "max_tokens": 6, **GREEDY})
                assert done["choices"][0]["text"] == long_text and live_samples(workers["g0"]) == 1
                short = await completion(http, config, {"prompt": prompt(32, 60), "max_tokens": 2, **GREEDY})
                assert short["usage"]["completion_tokens"] == 2 and live_samples(workers["p1"]) == 1

                gate_at[0] = calls[0] + 3  # the next long prompt's third chunk waits until g1 is dead
                doomed = prompt(33, 150)
                _, doomed_text = expected_text(doomed, 6)
                request = asyncio.ensure_future(completion(http, config, {"prompt": doomed, "max_tokens": 6,
                                                                          **GREEDY}))
                assert await asyncio.to_thread(reached.wait, 30.0)
                os.kill(stage1.pid, signal.SIGKILL)
                stage1.wait(10)
                resume.set()
                moved = await asyncio.wait_for(request, 30.0)
                assert moved["choices"][0]["text"] == doomed_text  # prefilled again by p1, the text unchanged
                assert live_samples(workers["p1"]) == 2
                assert (await metric(http, config, "mooncaked_migrations_total{")).startswith(
                    'mooncaked_migrations_total{cause="prefill_lost"} 1.0')
                assert not view.is_group_ready("g0")  # its failed leg marked every member down
                await eventually(lambda: view.prefill["g0"].is_up)  # g0 answers its polls again, g1 cannot
                assert not view.is_group_ready("g0")
                assert (await cluster_info(http, config))["prefill_groups"][0]["is_ready"] is False
                head = workers["g0"]
                assert isinstance(head, PrefillRole) and head.is_idle
                assert head.worker.pages is not None and head.worker.pages.num_free == head.worker.pages.num_pages

                while_down = await completion(http, config, {"prompt": prompt(34, 150), "max_tokens": 2, **GREEDY})
                assert while_down["usage"]["completion_tokens"] == 2 and live_samples(workers["p1"]) == 3

                stage1 = start_stage(tmp_path)  # the member is back: so is the group
                await eventually(lambda: view.is_group_ready("g0"), timeout_s=60.0)
                back = await completion(http, config, {"prompt": prompt(35, 150), "max_tokens": 2, **GREEDY})
                assert back["usage"]["completion_tokens"] == 2 and live_samples(workers["g0"]) == 2
    finally:
        resume.set()
        if stage1.poll() is None:
            stage1.send_signal(signal.SIGTERM)
            try:
                stage1.wait(15)
            except subprocess.TimeoutExpired:
                stage1.kill()
                stage1.wait(5)
