"""The OpenAI-compatible aiohttp application in front of a `GenerationBackend`.

1. `create_app` builds the application; the caller owns its runner (start/stop) and the backend.
2. Per request, middlewares in order: with a client guard, stop the request's header clock (client_guard.py);
   take the `X-Request-Id` header (or make one) and log the outcome;
   turn `ApiError` and aiohttp's HTTP errors into OpenAI error JSON; on /v1 routes, find the caller's tenant by
   its Bearer key when tenants or keys are configured (tenant_gate.py; /health and /metrics stay open for
   probes and scrapers); a generation request also passes its tenant's rate and concurrency limits.
3. Routes: POST /v1/completions, POST /v1/chat/completions (see `generation`), GET /v1/models,
   GET /health, GET /metrics, GET /v1/cluster. Every route that reads a body (these, and the cache, file and
   batch routes added later) reads it with `read_request_body` or `read_body_step`: within the app's body limit
   and the client guard's deadline (without a guard, `request_timeout_s`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from aiohttp import web
from aiohttp.typedefs import Middleware

from mooncaked.api.backend import GenerationBackend
from mooncaked.api.client_guard import ClientGuard
from mooncaked.api.errors import ApiError, error_response, internal_error
from mooncaked.api.generation import request_log, serve_generation
from mooncaked.api.requests import decode_json_body, parse_chat_request, parse_completion_requests
from mooncaked.api.tenant_gate import TenantGate
from mooncaked.api.tenants import Tenant, from_api_keys

logger = logging.getLogger(__name__)

REQUEST_ID_KEY = web.RequestKey("request_id", str)
CLIENT_ID_KEY = web.RequestKey("client_id", str)  # a digest of the caller's API key, set by the auth middleware
TENANT_KEY = web.RequestKey("tenant", Tenant)  # the caller's tenant, set by the auth middleware
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_REQUEST_ID_PATTERN = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
T = TypeVar("T")


@dataclass(frozen=True)
class BodyLimits:
    """How any route of the app may read a request body (set by create_app)."""

    max_body_bytes: int
    timeout_s: float  # without a client guard: the deadline of a body, or of one step of a streamed one
    client_guard: ClientGuard | None


BODY_LIMITS_KEY = web.AppKey("body_limits", BodyLimits)


async def read_request_body(request: web.Request) -> bytes:
    """The whole body: 413 over the app's limit, 408 past the client guard's deadline (without a guard, past
    `request_timeout_s`), 400 when the client hung up."""
    limits = request.app[BODY_LIMITS_KEY]
    if request.content_length is not None and request.content_length > limits.max_body_bytes:
        raise ApiError(413, f"The request body is {request.content_length} bytes; the limit is "
                       f"{limits.max_body_bytes}.", code="request_too_large")
    try:
        if limits.client_guard is not None:
            return await limits.client_guard.read_body(request)
        return await read_body_step(request, request.read())
    except ConnectionResetError:  # nobody is left to answer; say so in the log, not as a server error
        raise ApiError(400, "The client closed the connection before sending the whole body.",
                       code="client_closed") from None


async def read_body_step(request: web.Request, step: Awaitable[T]) -> T:
    """One step of a body read as a stream (an upload's next part or chunk), with a no-progress deadline."""
    limits = request.app[BODY_LIMITS_KEY]
    if limits.client_guard is not None:
        return await limits.client_guard.read_step(request, step)
    try:
        async with asyncio.timeout(limits.timeout_s):
            return await step
    except TimeoutError:
        raise ApiError(408, f"The request body made no progress for {limits.timeout_s:g} s; send it faster.",
                       code="request_timeout") from None


def create_app(
    backend: GenerationBackend, *, api_keys: frozenset[str] = frozenset(), gate: TenantGate | None = None,
    max_body_bytes: int, request_timeout_s: float, client_guard: ClientGuard | None = None,
) -> web.Application:
    """`request_timeout_s` bounds every wait without progress: admission, then each next chunk. `gate` (the
    tenants; the caller keeps it to reload them) defaults to one tenant holding `api_keys` (none: open). With
    `client_guard` (served through its GuardedSite) a request's headers and body must arrive in time."""
    if max_body_bytes <= 0 or request_timeout_s <= 0:
        raise ValueError("max_body_bytes and request_timeout_s must be positive")
    gate = gate or TenantGate(from_api_keys(api_keys))
    middlewares: list[Middleware] = [_request_id_middleware, _error_middleware, _auth_middleware(gate)]
    app = web.Application(
        client_max_size=max_body_bytes,
        middlewares=[client_guard.middleware, *middlewares] if client_guard is not None else middlewares,
    )
    app[BODY_LIMITS_KEY] = BodyLimits(max_body_bytes, request_timeout_s, client_guard)
    routes = _Routes(backend, gate, request_timeout_s=request_timeout_s)
    app.router.add_post("/v1/completions", routes.completions)
    app.router.add_post("/v1/chat/completions", routes.chat_completions)
    app.router.add_get("/v1/models", routes.models)
    app.router.add_get("/v1/cluster", routes.cluster)
    app.router.add_get("/health", routes.health)
    app.router.add_get("/metrics", routes.metrics)
    return app


@web.middleware
async def _request_id_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    given = request.headers.get("X-Request-Id", "")
    request_id = given if _REQUEST_ID_PATTERN.match(given) else uuid.uuid4().hex
    request[REQUEST_ID_KEY] = request_id
    log = request_log(request_id, logger)
    started = time.monotonic()
    log.debug("%s %s from %s", request.method, request.path, request.remote)
    response = await handler(request)
    log.info("%s %s -> %d in %.1f ms", request.method, request.path, response.status,
             (time.monotonic() - started) * 1e3)
    if not response.prepared:
        response.headers["X-Request-Id"] = request_id
    return response


@web.middleware
async def _error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    request_id = request[REQUEST_ID_KEY]
    try:
        return await handler(request)
    except ApiError as error:
        request_log(request_id, logger).info("rejected: %r", error)
        return error_response(error, request_id=request_id)
    except web.HTTPRequestEntityTooLarge as exc:
        too_large = ApiError(413, f"The request body is too large: {exc.text}", code="request_too_large")
        return error_response(too_large, request_id=request_id)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(ApiError(exc.status, exc.reason), request_id=request_id)
    except Exception:
        request_log(request_id, logger).exception("unhandled error")
        return error_response(internal_error("Internal server error."), request_id=request_id)


def _auth_middleware(gate: TenantGate) -> Middleware:
    @web.middleware
    async def check_api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith("/v1"):
            authorization = request.headers.get("Authorization", "")
            tenant = gate.identify(authorization)
            if tenant is not None:
                request[TENANT_KEY] = tenant
                token = authorization.partition(" ")[2].strip().encode("utf-8", "surrogatepass")
                request[CLIENT_ID_KEY] = hashlib.blake2b(token, digest_size=8).hexdigest()
        return await handler(request)

    return check_api_key


class _Routes:
    """Request handlers; holds no per-request state."""

    def __init__(self, backend: GenerationBackend, gate: TenantGate, *, request_timeout_s: float) -> None:
        self.backend = backend
        self.gate = gate
        self.request_timeout_s = request_timeout_s

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = decode_json_body(await read_request_body(request))
        api_requests = parse_completion_requests(
            body, request_id=request[REQUEST_ID_KEY], model_ids=self.backend.model_ids(),
            client_id=request.get(CLIENT_ID_KEY, ""), tenant=request.get(TENANT_KEY)
        )
        with self.gate.admit(api_requests[0].tenant):
            return await serve_generation(request, api_requests, self.backend, timeout_s=self.request_timeout_s,
                                          request_id=request[REQUEST_ID_KEY])

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = decode_json_body(await read_request_body(request))
        api_request = parse_chat_request(body, request_id=request[REQUEST_ID_KEY], model_ids=self.backend.model_ids(),
                                         client_id=request.get(CLIENT_ID_KEY, ""), tenant=request.get(TENANT_KEY))
        with self.gate.admit(api_request.tenant):
            return await serve_generation(request, [api_request], self.backend, timeout_s=self.request_timeout_s,
                                          request_id=request[REQUEST_ID_KEY])

    async def models(self, request: web.Request) -> web.Response:
        created = int(time.time())
        data = [
            {"id": model_id, "object": "model", "created": created, "owned_by": "mooncaked"}
            for model_id in self.backend.model_ids()
        ]
        return web.json_response({"object": "list", "data": data})

    async def cluster(self, request: web.Request) -> web.Response:
        return web.json_response(await self.backend.cluster_info())

    async def health(self, request: web.Request) -> web.Response:
        health = await self.backend.health()
        return web.json_response(health, status=200 if health.get("status") == "ok" else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.backend.metrics_text(), headers={"Content-Type": PROMETHEUS_CONTENT_TYPE})
