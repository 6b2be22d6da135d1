"""Parallel sampling through a whole in-process cluster (tiny random model): n choices from one prefill, each
sequence with its own seed stream (choice 0 samples as the request alone would), streamed interleaved by index,
usage counting the prompt once; best_of returns the most likely; the colocated path too. The n sequences share
the prompt's KV pages on the decode instance."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from mooncaked.config import Config
from mooncaked.roles.worker.decode.role import DecodeRole
from mooncaked.roles.worker.prefill.role import PrefillRole
from mooncaked.roles.worker.sampling import seed_for_token
from mooncaked.runtime.lifecycle import Role
from mooncaked.sched.decode_memory import num_pages_for
from tests.roles.cluster_fixtures import running_roles
from tests.roles.test_conductor_flow import make_config, prompt, url

TOKENS = prompt(21, 40)


class Live:
    def __init__(self, config: Config, http: aiohttp.ClientSession, roles: dict[str, Role]) -> None:
        self.config, self.http, self.roles = config, http, roles

    async def post(self, body: dict[str, Any], route: str = "/v1/completions") -> dict[str, Any]:
        async with self.http.post(url(self.config, route), json=body) as response:
            data: dict[str, Any] = await response.json()
            assert response.status == 200, data
            return data

    def num_prefills(self) -> int:
        prefill = self.roles.get("p0")
        role = prefill if isinstance(prefill, PrefillRole) else self.roles["d0"]
        assert isinstance(role, (PrefillRole, DecodeRole))
        return role.worker.perf.num_samples()["prefill_live"]


@pytest.fixture(params=["disaggregated", "colocated"])
async def live(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Live]:
    config = make_config(tmp_path, with_prefill=request.param == "disaggregated", worker={"profile_s": 0})
    names = ["s0", "p0", "d0", "c0"] if request.param == "disaggregated" else ["s0", "d0", "c0"]
    async with running_roles(config, names) as roles, aiohttp.ClientSession() as http:
        yield Live(config, http, roles)


async def test_n_choices_from_one_prefill_each_its_own_seed_stream(live: Live) -> None:
    body = {"prompt": TOKENS, "max_tokens": 12, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    alone = await live.post(body)
    before = live.num_prefills()
    answer = await live.post({**body, "n": 4})
    assert live.num_prefills() == before + 1
    texts = [choice["text"] for choice in answer["choices"]]
    assert [choice["index"] for choice in answer["choices"]] == [0, 1, 2, 3]
    assert texts[0] == alone["choices"][0]["text"] and len(set(texts)) > 1
    assert answer["usage"]["prompt_tokens"] == len(TOKENS) and answer["usage"]["completion_tokens"] == 4 * 12
    greedy = await live.post({**body, "temperature": 0.0, "n": 2})
    assert greedy["choices"][0]["text"] == greedy["choices"][1]["text"]


async def test_streamed_choices_interleave_and_reassemble(live: Live) -> None:
    body = {"messages": [{"role": "user", "content": "count"}], "max_tokens": 8, "temperature": 1.0, "seed": 3,
            "ignore_eos": True, "n": 3}
    whole = await live.post(body, "/v1/chat/completions")
    parts: dict[int, list[str]] = {0: [], 1: [], 2: []}
    order = []
    async with live.http.post(url(live.config, "/v1/chat/completions"), json={**body, "stream": True}) as response:
        async for raw in response.content:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                choice = json.loads(line.removeprefix("data: "))["choices"][0]
                parts[choice["index"]].append(choice["delta"].get("content") or "")
                order.append(choice["index"])
    assert ["".join(parts[i]) for i in range(3)] == [c["message"]["content"] for c in whole["choices"]]
    assert order != sorted(order)  # interleaved, not one choice after another


async def test_best_of_returns_the_most_likely_per_token(live: Live) -> None:
    body = {"prompt": TOKENS, "max_tokens": 6, "temperature": 1.0, "seed": 5, "ignore_eos": True}
    every = await live.post({**body, "n": 3, "logprobs": 0})
    means = [sum(c["logprobs"]["token_logprobs"]) / 6 for c in every["choices"]]
    best = await live.post({**body, "n": 1, "best_of": 3})
    assert len(best["choices"]) == 1 and best["choices"][0]["logprobs"] is None
    assert best["choices"][0]["text"] == every["choices"][means.index(max(means))]["text"]


async def test_each_choice_follows_the_constraint_on_its_own(live: Live) -> None:
    body = {"prompt": "code:", "max_tokens": 20, "temperature": 1.0, "seed": 9, "n": 3,
            "guided_regex": "[A-Z]{2}-[0-9]{2}"}
    answer = await live.post(body)
    texts = [choice["text"] for choice in answer["choices"]]
    assert all(len(text) == 5 and text[2] == "-" for text in texts) and len(set(texts)) > 1


async def test_n_sequences_share_the_prompt_pages_and_sample_as_separate_requests(live: Live) -> None:
    """Each of n = 4 sequences samples as a request of its own seed stream alone would (the shared prompt pages
    hold the prompt's KV for all of them); the decode instance holds the prompt's full blocks once and each
    sequence's tail and output pages, not 4 copies; every page is given back once the sequences end."""
    decode = live.roles["d0"]
    assert isinstance(decode, DecodeRole) and decode.worker.pages is not None
    pages, block_size = decode.worker.pages, live.config.kv.block_size
    tokens = prompt(22, 6 * block_size + 4)  # 6 full blocks and a partial one
    body = {"prompt": tokens, "max_tokens": 40, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    peak = 0
    forecasts: list[tuple[int, int]] = []  # (pages the admission forecast counts, pages in use) while all 4 run

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, pages.num_used)
            if len(decode.loop.running) == 4:
                holds = decode.admission.holds(time.monotonic(), 0.01)
                forecasts.append((sum(h.num_pages for h in holds), pages.num_used))
            await asyncio.sleep(0.001)

    watcher = asyncio.create_task(watch())
    try:
        together = await live.post({**body, "n": 4})
    finally:
        watcher.cancel()
    alone = [await live.post({**body, "seed": seed_for_token(11, -1 - q) if q else 11}) for q in range(4)]
    assert [c["text"] for c in together["choices"]] == [a["choices"][0]["text"] for a in alone]
    num_pages = num_pages_for(len(tokens), 40, block_size, num_sequences=4)
    assert num_pages == 6 + 4 * 3 and peak == num_pages < 4 * num_pages_for(len(tokens), 40, block_size)
    assert forecasts and all(counted == in_use == num_pages for counted, in_use in forecasts)
    greedy = await live.post({**body, "temperature": 0.0, "n": 4})
    single = await live.post({**body, "temperature": 0.0})
    assert [c["text"] for c in greedy["choices"]] == [single["choices"][0]["text"]] * 4
    async with asyncio.timeout(2.0):
        while pages.num_used:
            await asyncio.sleep(0.01)
