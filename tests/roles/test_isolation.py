"""KV isolation through a live cluster: requests with different cache salts never share KV (vLLM's cache_salt)."""

from __future__ import annotations

from pathlib import Path

import aiohttp

from tests.roles.cluster_fixtures import running_roles
from tests.roles.test_conductor_flow import GREEDY, completion, make_config, prompt


async def test_only_requests_with_the_same_cache_salt_share_kv(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    tokens = prompt(80, 70)  # 4 full blocks of 16 and a tail

    async def cached(**salt: str) -> int:
        reply = await completion(http, config, {"prompt": tokens, "max_tokens": 2, **GREEDY, **salt})
        return int(reply["usage"]["prompt_tokens_details"]["cached_tokens"])

    async with running_roles(config, ["s0", "p0", "d0", "c0"]), aiohttp.ClientSession() as http:
        assert await cached() == 0
        assert await cached() == 64  # unsalted requests share
        assert await cached(cache_salt="team-a") == 0  # a salt is its own namespace
        assert await cached(cache_salt="team-a") == 64
        assert await cached(cache_salt="team-b") == 0
        assert await cached(cache_salt="\ud800 odd \U0001f600") == 0  # any string, lone surrogates too
        async with http.post(f"http://127.0.0.1:{config.instance_named('c0').port}/v1/completions",
                             json={"prompt": tokens, "cache_salt": ""}) as response:
            assert response.status == 400 and (await response.json())["error"]["param"] == "cache_salt"
