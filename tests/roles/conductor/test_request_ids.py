"""Client-chosen request ids against a live cluster (store, prefill, decode, conductor; tiny model): requests that
share an `X-Request-Id` never share KV pages, reservations or store space on the instances."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from tests.roles.test_conductor_flow import GREEDY, make_config, prompt, running_roles, url

NUM_TOKENS = 24


async def answer(http: aiohttp.ClientSession, port_url: str, tokens: list[int], request_id: str) -> tuple[str, str]:
    body = {"prompt": tokens, "max_tokens": NUM_TOKENS, "stream": False, **GREEDY}
    async with http.post(port_url, json=body, headers={"X-Request-Id": request_id}) as response:
        data = await response.json()
        assert response.status == 200, data
        return data["choices"][0]["text"], response.headers["X-Request-Id"]


async def test_concurrent_requests_with_one_client_id_each_get_their_solo_answer(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    prompts = [prompt(40 + i, 40 + 7 * i) for i in range(5)]
    ids = ["same-id", "same-id", "same-id", "same-id", "other-id"]  # the last allocates beside them
    async with running_roles(config, ["s0", "p0", "d0", "c0"]), aiohttp.ClientSession() as http:
        route = url(config, "/v1/completions")
        solo = [(await answer(http, route, tokens, f"solo-{i}"))[0] for i, tokens in enumerate(prompts)]
        replies = await asyncio.wait_for(
            asyncio.gather(*(answer(http, route, tokens, rid) for tokens, rid in zip(prompts, ids))), 60)
    assert [text for text, _ in replies] == solo
    assert [header for _, header in replies] == ids  # the client's id comes back as it was sent
