"""Tenants through a live cluster: private KV per tenant and per cache_salt, rate limits, unknown keys, per-tenant
metrics and a reload that keeps the old tenants when the new file is bad."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp

from mooncaked.roles.conductor.role import ConductorRole
from tests.roles.cluster_fixtures import running_roles
from tests.roles.test_conductor_flow import GREEDY, make_config, prompt, url

TENANTS = """\
tenants:
  - id: team-a
    api_keys: [key-a]
  - id: team-b
    api_keys: [key-b]
  - id: slow
    api_keys: [key-slow]
    requests_per_s: 1
"""


async def post(http: aiohttp.ClientSession, address: str, key: str, body: dict[str, Any]) -> aiohttp.ClientResponse:
    async with http.post(address, json=body, headers={"Authorization": f"Bearer {key}"}) as response:
        await response.read()
        return response


async def test_tenants_share_kv_only_inside_and_hit_their_own_limits(tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(TENANTS)
    config = make_config(tmp_path, conductor={"tenants_file": str(tenants), "retry_after_s": 1})
    address = url(config, "/v1/completions")
    tokens = prompt(90, 70)

    async def cached(key: str, **extra: str) -> int:
        async with http.post(address, json={"prompt": tokens, "max_tokens": 2, **GREEDY, **extra},
                             headers={"Authorization": f"Bearer {key}"}) as response:
            data = await response.json()
            assert response.status == 200, data
        return int(data["usage"]["prompt_tokens_details"]["cached_tokens"])

    async with running_roles(config, ["s0", "p0", "d0", "c0"]) as roles, aiohttp.ClientSession() as http:
        assert await cached("key-a") == 0
        assert await cached("key-a") == 64  # a tenant's second request reuses its first's KV
        assert await cached("key-b") == 0  # another tenant's first does not see it
        assert await cached("key-a", cache_salt="s") == 0  # nor does a different salt inside the tenant
        assert (await post(http, address, "key-z", {"prompt": tokens})).status == 401
        burst = await asyncio.gather(*(post(http, address, "key-slow", {"prompt": prompt(91 + i, 20),
                                                                       "max_tokens": 2, **GREEDY})
                                       for i in range(6)))
        statuses = sorted(r.status for r in burst)
        assert statuses.count(429) >= 1 and set(statuses) == {200, 429}, statuses
        assert all(r.headers["Retry-After"] == "1" for r in burst if r.status == 429)
        async with http.get(url(config, "/metrics")) as response:
            metrics = await response.text()
        assert 'mooncaked_tenant_requests_total{status="ok",tenant="team-a"} 3.0' in metrics
        assert 'mooncaked_tenant_tokens_total{kind="cached",tenant="team-a"} 64.0' in metrics
        assert 'mooncaked_tenant_rejections_total{reason="rate_limit",tenant="slow"}' in metrics
        conductor = roles["c0"]
        assert isinstance(conductor, ConductorRole)
        tenants.write_text(TENANTS.replace("api_keys: [key-b]", "api_keys: key-b"))  # broken: a string
        assert not conductor.reload_tenants()
        assert (await post(http, address, "key-b", {"prompt": prompt(99, 8), "max_tokens": 1})).status == 200
        tenants.write_text(TENANTS.replace("key-b]", "key-b2]"))
        assert conductor.reload_tenants()
        assert (await post(http, address, "key-b", {"prompt": prompt(99, 8), "max_tokens": 1})).status == 401
        assert (await post(http, address, "key-b2", {"prompt": prompt(99, 8), "max_tokens": 1})).status == 200


FLOODED = """\
tenants:
  - id: flood
    api_keys: [key-flood]
    pool_share: 0.5
  - id: warm
    api_keys: [key-warm]
    min_pool_share: 0.1
"""


async def test_a_tenant_flooding_the_pool_leaves_anothers_warm_prefix_alone(tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(FLOODED)
    # 160 blocks of 8 KiB (tiny model, 16-token blocks): the flood writes ~350 blocks
    config = make_config(tmp_path, conductor={"tenants_file": str(tenants)}, store={"dram_bytes": 160 * 8192})
    address = url(config, "/v1/completions")
    warm = prompt(120, 70)

    async def cached(key: str, tokens: list[int]) -> int:
        async with http.post(address, json={"prompt": tokens, "max_tokens": 1, **GREEDY},
                             headers={"Authorization": f"Bearer {key}"}) as response:
            data = await response.json()
            assert response.status == 200, data
        return int(data["usage"]["prompt_tokens_details"]["cached_tokens"])

    async with running_roles(config, ["s0", "p0", "d0", "c0"]) as roles, aiohttp.ClientSession() as http:
        assert await cached("key-warm", warm) == 0
        for i in range(30):
            await cached("key-flood", prompt(121 + i, 190))
        store = roles["s0"]
        usage = store.service.core.tenants.dram_bytes  # type: ignore[attr-defined]
        capacity = store.service.core.allocator.capacity_bytes  # type: ignore[attr-defined]
        assert usage["flood"] <= capacity // 2 + 8192 and usage["warm"] == 4 * 8192
        assert await cached("key-warm", warm) == 64  # still a hit after the flood
        async with http.get(f"http://127.0.0.1:{config.instance_named('c0').port}/metrics") as response:
            assert 'mooncaked_tenant_tokens_total{kind="cached",tenant="warm"} 64.0' in await response.text()


async def test_a_tenants_context_cache_serves_that_tenant_only(tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(TENANTS)
    config = make_config(tmp_path, conductor={"tenants_file": str(tenants)})
    context = prompt(130, 70)
    async with running_roles(config, ["s0", "p0", "d0", "c0"]), aiohttp.ClientSession() as http:
        created = await post(http, url(config, "/v1/caches"), "key-a", {"prompt": context, "ttl_s": 600})
        assert created.status == 200
        for key, expected in (("key-a", 64), ("key-b", 0)):
            async with http.post(url(config, "/v1/completions"), headers={"Authorization": f"Bearer {key}"},
                                 json={"prompt": context, "max_tokens": 1, **GREEDY}) as response:
                usage = (await response.json())["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] == expected, key
