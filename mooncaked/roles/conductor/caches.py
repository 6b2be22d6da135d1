"""Context caches with a TTL (POST /v1/caches ...): prefilled once, pinned in the stores until they expire.

1. `create_cache`: tokenize the context (a chat's template without the generation prompt, or a prompt, as the
   completion routes tokenize theirs), check the caller's quota (conductor.cache_quota_tokens) against a fresh
   listing, prefill it as an ordinary request of one token (its blocks land in the prefill and decode hosts'
   stores), then CACHE_PIN its full blocks in every store that holds them all. Later requests whose prompt
   starts with the context reuse it through the ordinary prefix path, no id needed.
2. The listing is never this conductor's alone: `refresh()` rebuilds it from every store's records (CACHE_LIST),
   so a restarted conductor, or any of several, lists the same caches. It runs every conductor.cache_refresh_s
   and before each API answer. A store that does not answer keeps its last known caches; a cache that no store
   holds any more, before it expired, is logged as lost.
3. Each refresh also pins a cache in every further store the shadow index shows holding all its blocks: a hot
   context the scheduler replicated (Algorithm 1's fetch of a long prefix) stays pinned there too.
4. PATCH pins again with a new TTL where it is held; DELETE unpins it everywhere.

Owns the listing, the per-key creation lock and the refresh task; borrows the view, the peers and the backend.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from mooncaked.api.cache_routes import CacheCreate, cache_not_found
from mooncaked.api.errors import ApiError, context_too_long, invalid_field, unavailable
from mooncaked.api.requests import ChatRequest, CompletionRequest
from mooncaked.api.sampling_options import SamplingOptions
from mooncaked.config import Config
from mooncaked.kv.keys import block_keys, isolated_namespace
from mooncaked.roles.base import PeerClients
from mooncaked.roles.conductor.frontend import ModelFrontend, key_isolation, prompt_token_ids
from mooncaked.roles.conductor.view.cluster import ClusterView
from mooncaked.rpc import RpcError
from mooncaked.runtime.keyed_locks import KeyedLocks
from mooncaked.runtime.supervised import start_supervised, stop_task
from mooncaked.store import cache_messages as msg
from mooncaked.store.cache_records import CacheInfo

logger = logging.getLogger(__name__)

Complete = Callable[[CompletionRequest], Awaitable[dict[str, Any]]]


@dataclass
class ListedCache:
    info: CacheInfo
    keys: tuple[bytes, ...]
    holders: set[str] = field(default_factory=set)  # stores holding it pinned

    def as_json(self) -> dict[str, Any]:
        info = self.info
        return {"id": info.cache_id, "object": "cache", "model": info.model, "num_tokens": info.num_tokens,
                "created_at": int(info.created_at), "expires_at": int(info.expires_at)}


class CacheRegistry:
    """See the module docstring."""

    def __init__(self, config: Config, model: ModelFrontend, view: ClusterView, peers: PeerClients,
                 namespace: bytes, complete: Complete) -> None:
        self.config = config
        self.model = model
        self.view = view
        self.peers = peers
        self.namespace = namespace
        self.complete = complete
        self.listed: dict[str, ListedCache] = {}
        self._create_locks = KeyedLocks()  # one creation at a time per client (its quota)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = start_supervised("cache-refresh", self._refresh_loop)

    async def stop(self) -> None:
        task, self._task = self._task, None
        await stop_task(task)

    # ---- the API -----------------------------------------------------------------------------------------
    async def create_cache(self, spec: CacheCreate) -> dict[str, Any]:
        token_ids = await prompt_token_ids(self.model, spec.context, add_generation_prompt=False)
        block_size = self.config.kv.block_size
        if len(token_ids) < block_size:
            raise invalid_field("messages" if isinstance(spec.context, ChatRequest) else "prompt",
                                f"the context has {len(token_ids)} tokens; a cache needs at least one block "
                                f"({block_size} tokens)")
        if len(token_ids) + 1 > self.model.context_length:
            raise context_too_long(len(token_ids), self.model.context_length)
        async with self._create_locks.hold(spec.client_id):
            await self.refresh()
            self._check_quota(spec.client_id, len(token_ids))
            cache_id = "cache-" + uuid.uuid4().hex[:24]
            await self.complete(_prefill_request(cache_id, spec, token_ids))
            now = time.time()
            info = CacheInfo(cache_id, spec.client_id, spec.model, len(token_ids), now, now + spec.ttl_s)
            namespace = isolated_namespace(self.namespace, key_isolation(spec.context))
            keys = tuple(block_keys(token_ids, block_size, namespace))
            listed = ListedCache(info, keys)
            listed.holders = await self._pin(listed, self._up_stores())
            if not listed.holders:
                raise unavailable("The context was prefilled but no store holds all of its blocks now; retry.")
            self.listed[cache_id] = listed
        logger.info("cache %s: %d tokens pinned in %s until %.0f", cache_id, info.num_tokens,
                    sorted(listed.holders), info.expires_at)
        return listed.as_json()

    async def list_caches(self, client_id: str) -> list[dict[str, Any]]:
        await self.refresh()
        return [c.as_json() for c in self._owned(client_id)]

    async def get_cache(self, cache_id: str, client_id: str) -> dict[str, Any]:
        await self.refresh()
        return self._find(cache_id, client_id).as_json()

    async def update_cache(self, cache_id: str, client_id: str, ttl_s: float) -> dict[str, Any]:
        await self.refresh()
        listed = self._find(cache_id, client_id)
        info = listed.info
        listed.info = CacheInfo(info.cache_id, info.owner, info.model, info.num_tokens, info.created_at,
                                time.time() + ttl_s)
        listed.holders = await self._pin(listed, sorted(listed.holders))
        if not listed.holders:
            self.listed.pop(cache_id, None)
            raise cache_not_found(cache_id)
        return listed.as_json()

    async def delete_cache(self, cache_id: str, client_id: str) -> dict[str, Any]:
        await self.refresh()
        self._find(cache_id, client_id)
        stores = self._up_stores()
        await asyncio.gather(*(self._call(name, msg.CACHE_UNPIN, msg.CacheUnpinRequest(cache_id)) for name in stores))
        self.listed.pop(cache_id, None)
        return {"id": cache_id, "object": "cache.deleted", "deleted": True}

    # ---- the listing -------------------------------------------------------------------------------------
    async def refresh(self) -> None:
        """Rebuild the listing from every store that answers; see the module docstring."""
        stores = self._up_stores()
        replies = await asyncio.gather(*(self._call(name, msg.CACHE_LIST, msg.CacheListRequest())
                                         for name in stores))
        now = time.time()
        fresh: dict[str, ListedCache] = {}
        answered = {name for name, reply in zip(stores, replies) if reply is not None}
        for name, reply in zip(stores, replies):
            for held in reply.caches if reply is not None else []:
                info = held.info.info()
                entry = fresh.setdefault(info.cache_id, ListedCache(info, tuple(held.keys)))
                if info.expires_at > entry.info.expires_at:
                    entry.info = info
                entry.holders.add(name)
        for cache_id, old in self.listed.items():
            kept = {h for h in old.holders if h not in answered and h in self.view.followers}
            if cache_id not in fresh and kept and old.info.expires_at > now:
                fresh[cache_id] = ListedCache(old.info, old.keys, kept)
            elif cache_id not in fresh and old.info.expires_at > now:
                logger.warning("cache %s lost before it expired: no store holds it any more (it was pinned in %s)",
                               cache_id, ", ".join(sorted(old.holders)))
        self.listed = fresh
        await self._replicate()

    async def _replicate(self) -> None:
        up = set(self._up_stores())
        for listed in list(self.listed.values()):
            lengths = self.view.index.prefix_lengths(listed.keys)
            more = [s for s, n in lengths.items() if n >= len(listed.keys) and s in up and s not in listed.holders]
            if more:
                added = await self._pin(listed, more)
                if added:
                    logger.info("cache %s: replica pinned in %s", listed.info.cache_id, ", ".join(sorted(added)))
                listed.holders |= added

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.conductor.cache_refresh_s)
            try:
                await self.refresh()
            except Exception:
                logger.exception("cache listing refresh failed")

    # ---- helpers -----------------------------------------------------------------------------------------
    def _check_quota(self, client_id: str, num_tokens: int) -> None:
        quota = self.config.conductor.cache_quota_tokens
        held = sum(c.info.num_tokens for c in self._owned(client_id))
        if held + num_tokens > quota:
            raise ApiError(429, f"This API key's context caches hold {held} tokens; {num_tokens} more would exceed "
                           f"the quota conductor.cache_quota_tokens = {quota}. Delete a cache or let one expire.",
                           code="cache_quota_exceeded", param="conductor.cache_quota_tokens")

    def _owned(self, client_id: str) -> list[ListedCache]:
        now = time.time()
        return sorted((c for c in self.listed.values() if c.info.owner == client_id and c.info.expires_at > now),
                      key=lambda c: c.info.created_at)

    def _find(self, cache_id: str, client_id: str) -> ListedCache:
        listed = self.listed.get(cache_id)
        if listed is None or listed.info.owner != client_id or listed.info.expires_at <= time.time():
            raise cache_not_found(cache_id)
        return listed

    async def _pin(self, listed: ListedCache, stores: list[str]) -> set[str]:
        """Pin `listed` until its expiry in `stores`; the stores that hold it all and pinned it."""
        ttl_ms = max(int((listed.info.expires_at - time.time()) * 1000), 1)
        request = msg.CachePinRequest(msg.CacheInfoMessage.of(listed.info), list(listed.keys), ttl_ms)
        replies = await asyncio.gather(*(self._call(name, msg.CACHE_PIN, request) for name in stores))
        return {name for name, reply in zip(stores, replies) if reply is not None and reply.is_pinned}

    def _up_stores(self) -> list[str]:
        return sorted(name for name, follower in self.view.followers.items() if follower.is_up)

    async def _call(self, store: str, method: Any, request: Any) -> Any:
        """One store call within rpc.call_timeout_s; None (logged) when it fails."""
        try:
            client = self.peers.for_instance(self.view.instance_config(store))
            return await client.call(method, request, timeout_s=self.config.rpc.call_timeout_s)
        except (RpcError, KeyError) as exc:
            logger.warning("%s on store %s failed: %s", method.name, store, exc)
            return None


def _prefill_request(cache_id: str, spec: CacheCreate, token_ids: list[int]) -> CompletionRequest:
    """The context as a one-token greedy completion: its prefill stores the blocks that get pinned."""
    sampling = SamplingOptions(max_tokens=1, temperature=0.0, top_p=1.0, top_k=0, seed=None, stop=(),
                               ignore_eos=True)
    return CompletionRequest(request_id=cache_id, model=spec.model, prompt=tuple(token_ids), sampling=sampling,
                             stream=False, include_usage=False, logprobs=None, client_id=spec.client_id,
                             cache_salt=spec.context.cache_salt, tenant=spec.context.tenant)

