"""HTTP routes of context caches: POST/GET /v1/caches, GET/PATCH/DELETE /v1/caches/{id}.

1. `add_cache_routes(app, service, ...)` adds the routes to the app `create_app` built (its middlewares, request
   ids, OpenAI error JSON and API keys apply to them too).
2. POST parses `model`, `messages` or `prompt` (the same readers as the completion routes) and `ttl_s`
   (bounded by conductor.max_cache_ttl_s) into a `CacheCreate`; PATCH reads `ttl_s`.
3. The `CacheService` (the conductor's cache registry) does the rest; every answer is scoped to the caller's API key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web

from mooncaked.api.app import CLIENT_ID_KEY, REQUEST_ID_KEY, TENANT_KEY, read_request_body
from mooncaked.api.errors import ApiError, invalid_field
from mooncaked.api.fields import json_type
from mooncaked.api.requests import ChatRequest, CompletionRequest, decode_json_body, parse_chat_request
from mooncaked.api.requests import parse_completion_request
from mooncaked.api.tenants import Tenant

CACHE_ID_PATTERN = re.compile(r"^cache-[0-9a-f]{24}$")


@dataclass(frozen=True)
class CacheCreate:
    """A parsed POST /v1/caches: the context as a chat (no generation prompt) or a prompt, and its TTL."""

    request_id: str
    client_id: str
    model: str
    context: ChatRequest | CompletionRequest
    ttl_s: float


class CacheService(Protocol):
    async def create_cache(self, spec: CacheCreate) -> dict[str, Any]: ...

    async def list_caches(self, client_id: str) -> list[dict[str, Any]]: ...

    async def get_cache(self, cache_id: str, client_id: str) -> dict[str, Any]: ...

    async def update_cache(self, cache_id: str, client_id: str, ttl_s: float) -> dict[str, Any]: ...

    async def delete_cache(self, cache_id: str, client_id: str) -> dict[str, Any]: ...


def cache_not_found(cache_id: str) -> ApiError:
    return ApiError(404, f"No cache with id {cache_id!r}: it expired, was deleted, or belongs to another API key; "
                    "GET /v1/caches lists yours.", param="cache_id", code="not_found")


def read_ttl(body: dict[str, Any], default_s: float, max_s: float) -> float:
    value = body.get("ttl_s")
    if value is None:
        return default_s
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise invalid_field("ttl_s", f"expected a number of seconds, got {json_type(value)}")
    if not 0 < value <= max_s:
        raise invalid_field("ttl_s", f"must be > 0 and at most {max_s:g} s (conductor.max_cache_ttl_s), got {value}")
    return float(value)


def parse_cache_create(body: dict[str, Any], *, request_id: str, client_id: str, model_ids: list[str],
                       default_ttl_s: float, max_ttl_s: float, tenant: Tenant | None = None) -> CacheCreate:
    """A cache's KV lives in its creator's namespace (its tenant's, and its `cache_salt`'s when given): the
    requests that may reuse it are those that could share KV with it."""
    has_messages, has_prompt = body.get("messages") is not None, body.get("prompt") is not None
    if has_messages == has_prompt:
        raise invalid_field("messages", "give either messages (a chat) or prompt (text or token ids), not both")
    fields = {"model": body.get("model"), "cache_salt": body.get("cache_salt")}
    context: ChatRequest | CompletionRequest
    if has_messages:
        context = parse_chat_request({**fields, "messages": body["messages"]}, request_id=request_id,
                                     model_ids=model_ids, client_id=client_id, tenant=tenant)
    else:
        context = parse_completion_request({**fields, "prompt": body["prompt"]}, request_id=request_id,
                                           model_ids=model_ids, client_id=client_id, tenant=tenant)
    return CacheCreate(request_id, client_id, context.model, context, read_ttl(body, default_ttl_s, max_ttl_s))


class CacheRoutes:
    """Request handlers; holds no per-request state."""

    def __init__(self, service: CacheService, model_ids: list[str], *, default_ttl_s: float, max_ttl_s: float) -> None:
        self.service = service
        self.model_ids = model_ids
        self.default_ttl_s = default_ttl_s
        self.max_ttl_s = max_ttl_s

    async def create(self, request: web.Request) -> web.Response:
        body = decode_json_body(await read_request_body(request))
        spec = parse_cache_create(body, request_id=request[REQUEST_ID_KEY], client_id=_client(request),
                                  model_ids=self.model_ids, default_ttl_s=self.default_ttl_s,
                                  max_ttl_s=self.max_ttl_s, tenant=request.get(TENANT_KEY))
        return web.json_response(await self.service.create_cache(spec))

    async def list(self, request: web.Request) -> web.Response:
        data = await self.service.list_caches(_client(request))
        return web.json_response({"object": "list", "data": data})

    async def get(self, request: web.Request) -> web.Response:
        return web.json_response(await self.service.get_cache(_cache_id(request), _client(request)))

    async def update(self, request: web.Request) -> web.Response:
        cache_id = _cache_id(request)
        body = decode_json_body(await read_request_body(request))
        if body.get("ttl_s") is None:
            raise invalid_field("ttl_s", "PATCH sets a new ttl_s (seconds from now)")
        ttl_s = read_ttl(body, self.default_ttl_s, self.max_ttl_s)
        return web.json_response(await self.service.update_cache(cache_id, _client(request), ttl_s))

    async def delete(self, request: web.Request) -> web.Response:
        return web.json_response(await self.service.delete_cache(_cache_id(request), _client(request)))


def add_cache_routes(app: web.Application, service: CacheService, model_ids: list[str], *, default_ttl_s: float,
                     max_ttl_s: float) -> None:
    routes = CacheRoutes(service, model_ids, default_ttl_s=default_ttl_s, max_ttl_s=max_ttl_s)
    app.router.add_post("/v1/caches", routes.create)
    app.router.add_get("/v1/caches", routes.list)
    app.router.add_get("/v1/caches/{cache_id}", routes.get)
    app.router.add_patch("/v1/caches/{cache_id}", routes.update)
    app.router.add_delete("/v1/caches/{cache_id}", routes.delete)


def _client(request: web.Request) -> str:
    return request.get(CLIENT_ID_KEY, "")


def _cache_id(request: web.Request) -> str:
    cache_id = request.match_info["cache_id"]
    if not CACHE_ID_PATTERN.match(cache_id):
        raise cache_not_found(cache_id[:64])
    return cache_id
