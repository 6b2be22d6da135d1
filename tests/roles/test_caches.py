"""Context caches through a whole in-process cluster (tiny random model, loopback), driven over HTTP and with
the official `openai` client: pins in the store, reuse reported in cached_tokens, quotas, expiry, restarts."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from mooncaked.config import Config
from mooncaked.kv.keys import block_keys
from mooncaked.roles.conductor.role import ConductorRole
from mooncaked.roles.store import StoreRole
from mooncaked.runtime.lifecycle import Role
from tests.roles.cluster_fixtures import cluster_config, instance, running_roles
from tests.roles.test_conductor_flow import make_config, prompt, url

KEYS = {"alice": "sk-alice", "bob": "sk-bob"}


def keyed_config(tmp_path: Path, **conductor: Any) -> Config:
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text("\n".join(KEYS.values()) + "\n")
    return make_config(tmp_path, conductor={"api_keys_file": str(keys_file), **conductor})


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


async def call(http: aiohttp.ClientSession, method: str, config: Config, path: str, who: str = "alice",
               body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    async with http.request(method, url(config, path), json=body, headers=auth(who)) as response:
        return response.status, await response.json()


def pinned_keys(roles: dict[str, Role], tokens: list[int]) -> list[bool]:
    conductor = roles["c0"]
    store = roles["s0"]
    keys = block_keys(tokens, 16, conductor.backend.namespace)  # type: ignore[attr-defined]
    return [store.service.core.is_pinned(k, time.monotonic()) for k in keys]  # type: ignore[attr-defined]


async def until(predicate: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def test_cache_crud_reuse_in_cached_tokens_and_restart(tmp_path: Path) -> None:
    config = keyed_config(tmp_path)
    context = prompt(11, 70)  # 4 full blocks of 16 and a tail
    async with running_roles(config, ["s0", "p0", "d0"]) as roles, aiohttp.ClientSession() as http:
        async with running_roles(config, ["c0"]) as conductor:
            roles.update(conductor)
            status, cache = await call(http, "POST", config, "/v1/caches", body={"prompt": context, "ttl_s": 600})
            assert status == 200, cache
            assert cache["object"] == "cache" and cache["model"] == "tiny" and cache["num_tokens"] == 70
            assert 599 <= cache["expires_at"] - cache["created_at"] <= 601
            assert pinned_keys(roles, context) == [True] * 4
            client = openai.AsyncOpenAI(base_url=url(config, "/v1"), api_key=KEYS["alice"], max_retries=0)
            reply = await client.completions.create(model="tiny", prompt=context + [5, 6, 7], max_tokens=2,
                                                    temperature=0.0)
            assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
            assert reply.usage.prompt_tokens_details.cached_tokens == 64
            await client.close()
            status, listing = await call(http, "GET", config, "/v1/caches")
            assert (status, [c["id"] for c in listing["data"]]) == (200, [cache["id"]])
            status, others = await call(http, "GET", config, "/v1/caches", who="bob")
            assert (status, others["data"]) == (200, [])
            status, error = await call(http, "GET", config, f"/v1/caches/{cache['id']}", who="bob")
            assert status == 404 and error["error"]["code"] == "not_found"
        async with running_roles(config, ["c0"]) as conductor:  # a restarted conductor lists it from the pins
            roles.update(conductor)
            status, again = await call(http, "GET", config, f"/v1/caches/{cache['id']}")
            assert (status, again) == (200, cache)
            status, patched = await call(http, "PATCH", config, f"/v1/caches/{cache['id']}", body={"ttl_s": 1200})
            assert status == 200 and patched["expires_at"] >= cache["expires_at"] + 599
            status, deleted = await call(http, "DELETE", config, f"/v1/caches/{cache['id']}")
            assert (status, deleted) == (200, {"id": cache["id"], "object": "cache.deleted", "deleted": True})
            assert pinned_keys(roles, context) == [False] * 4
            status, error = await call(http, "GET", config, f"/v1/caches/{cache['id']}")
            assert status == 404 and set(error["error"]) == {"message", "type", "param", "code"}


async def test_quota_bad_input_and_expiry(tmp_path: Path) -> None:
    config = keyed_config(tmp_path, cache_quota_tokens=150, max_cache_ttl_s=60.0, default_cache_ttl_s=60.0)
    async with running_roles(config, ["s0", "p0", "d0", "c0"]) as roles, aiohttp.ClientSession() as http:
        status, first = await call(http, "POST", config, "/v1/caches", body={"prompt": prompt(1, 70)})
        assert status == 200, first
        status, error = await call(http, "POST", config, "/v1/caches", body={"prompt": prompt(2, 90)})
        assert status == 429 and error["error"]["code"] == "cache_quota_exceeded"
        assert "conductor.cache_quota_tokens = 150" in error["error"]["message"]
        status, _ = await call(http, "POST", config, "/v1/caches", who="bob", body={"prompt": prompt(2, 40)})
        assert status == 200  # the quota is per API key
        assert len(roles["c0"].caches._create_locks) == 0, "no lock kept per client"  # type: ignore[attr-defined]
        for body, param in [({"prompt": prompt(3, 40), "ttl_s": 61}, "ttl_s"),
                            ({"prompt": prompt(3, 40), "ttl_s": "1h"}, "ttl_s"),
                            ({"prompt": prompt(3, 8)}, "prompt"),
                            ({"prompt": prompt(3, 40), "messages": [{"role": "user", "content": "x"}]}, "messages"),
                            ({"prompt": prompt(3, 40), "model": "nope"}, "model")]:
            status, error = await call(http, "POST", config, "/v1/caches", who="bob", body=body)
            assert status in (400, 404) and error["error"]["param"] == param, (body, error)
        status, error = await call(http, "PATCH", config, "/v1/caches/cache-nothere", body={"ttl_s": 5})
        assert status == 404 and error["error"]["type"] == "invalid_request_error"
        status, error = await call(http, "GET", config, "/v1/batches")  # no conductor.batch_dir here
        assert status == 404 and "conductor.batch_dir" in error["error"]["message"]
        context = prompt(4, 40)
        status, short = await call(http, "POST", config, "/v1/caches", who="bob",
                                   body={"messages": [{"role": "user", "content": "hi " * 5}], "ttl_s": 0.5})
        assert status == 200, short
        status, short = await call(http, "POST", config, "/v1/caches", who="bob", body={"prompt": context,
                                                                                         "ttl_s": 0.5})
        assert status == 200 and pinned_keys(roles, context) == [True, True]

        async def expired() -> bool:
            status, _ = await call(http, "GET", config, f"/v1/caches/{short['id']}", who="bob")
            return status == 404 and pinned_keys(roles, context) == [False, False]

        await until(expired, timeout_s=10.0)


async def test_a_replica_gets_pinned_and_a_cache_is_lost_only_with_its_last_store(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A second store (another host) that comes to hold every block of a cache, as Algorithm 1's fetch of a hot
    prefix makes it, is pinned too at the next refresh; the cache outlives one store forgetting it, not both."""
    config = cluster_config(tmp_path, [instance("s0", "store"), instance("p0", "prefill"), instance("d0", "decode"),
                                       instance("s1", "store", "127.0.0.2"), instance("c0", "conductor")],
                            worker={"inline_prefill_max_tokens": 0})
    context = prompt(21, 48)
    async with running_roles(config, ["s0", "s1", "p0", "d0", "c0"]) as roles, aiohttp.ClientSession() as http:
        async with http.post(url(config, "/v1/caches"), json={"prompt": context}) as response:
            cache = await response.json()
            assert response.status == 200, cache
        conductor, replica = roles["c0"], roles["s1"]
        assert isinstance(conductor, ConductorRole) and isinstance(replica, StoreRole)
        registry, view = conductor.caches, conductor.view
        assert registry is not None and view is not None
        listed = registry.listed[cache["id"]]
        assert listed.holders == {"s0"}
        core, now = replica.service.core, time.monotonic()
        grants, _, _ = core.allocate(list(listed.keys), 4096, 10_000, now)  # the copy a fetch would make
        core.commit([g.handle_id for g in grants], now)

        async def indexed() -> bool:
            return view.index.prefix_lengths(listed.keys).get("s1", 0) == len(listed.keys)

        await until(indexed, timeout_s=10.0)
        await registry.refresh()
        assert registry.listed[cache["id"]].holders == {"s0", "s1"}
        assert all(core.is_pinned(key, time.monotonic()) for key in listed.keys)
        first = roles["s0"]
        assert isinstance(first, StoreRole)
        for key in listed.keys:  # the first store loses the blocks (what a store restarted without SSD does)
            first.service.core._remove_block(key)
        await registry.refresh()
        assert registry.listed[cache["id"]].holders == {"s1"} and "lost before it expired" not in caplog.text
        for key in listed.keys:
            core._remove_block(key)
        with caplog.at_level(logging.WARNING):
            await registry.refresh()
        assert cache["id"] not in registry.listed and f"cache {cache['id']} lost before it expired" in caplog.text
