"""A small etcd v3 client over etcd's own JSON gateway (the grpc-gateway every etcd >= 3.4 serves), on aiohttp.

1. `EtcdClient(endpoints, call_timeout_s, ssl_context=..., auth=...)` opens one aiohttp session; every call is a
   POST of JSON to `/v3/...` with its own deadline, tried on each endpoint in turn (the last one that answered
   first). https:// endpoints are verified with `ssl_context` (its CA, and a client certificate when etcd asks
   for one). With `auth` (etcd's user authentication) the client gets a token (`/v3/auth/authenticate`) before
   its first call and sends it with every call and watch; a token etcd no longer accepts is got again once.
2. Keys and values are bytes on our side and base64 on the wire; int64 fields arrive as decimal strings.
3. `watch_prefix()` is one streaming POST: each line of the response is one `{"result": WatchResponse}`.
   An idle stream ends after `idle_s` (aiohttp's read timeout) and the caller reopens it from the revision it
   saw last, so even a watch has a deadline.
4. `close()` closes the session.

Why the gateway and not a gRPC client: aiohttp is already a dependency, the gateway is part of etcd itself
(nothing else to keep in step with etcd's releases), and every call gets an exact deadline.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import ssl
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

logger = logging.getLogger(__name__)


class EtcdError(Exception):
    """etcd answered with an error (`code` is the gRPC status code), or gave a reply we cannot read."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code


class EtcdUnavailable(EtcdError):
    """No endpoint answered within the deadline."""


class WatchCompacted(EtcdError):
    """The revision a watch asked for was compacted away: list again, then watch from the new revision."""


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


@dataclass(frozen=True)
class WatchEvent:
    kind: Literal["put", "delete"]
    kv: KeyValue


@dataclass(frozen=True)
class EtcdAuth:
    """etcd user credentials (`password` is never shown)."""

    username: str
    password: str = field(repr=False)


_UNAUTHENTICATED = 16  # gRPC status of a missing, wrong or expired token


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def prefix_end(prefix: bytes) -> bytes:
    """The smallest key greater than every key starting with `prefix` (etcd's range_end for a prefix)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


def _kv(data: dict[str, Any]) -> KeyValue:
    return KeyValue(base64.b64decode(data.get("key", "")), base64.b64decode(data.get("value", "")),
                    int(data.get("create_revision", 0)), int(data.get("mod_revision", 0)), int(data.get("lease", 0)))


class EtcdClient:
    """Owns one aiohttp session to the endpoints of one etcd cluster."""

    def __init__(self, endpoints: Sequence[str], call_timeout_s: float, *, ssl_context: ssl.SSLContext | None = None,
                 auth: EtcdAuth | None = None) -> None:
        if not endpoints:
            raise ValueError("EtcdClient needs at least one endpoint")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.call_timeout_s = call_timeout_s
        self._ssl_context = ssl_context
        self._auth = auth
        self._token = ""  # etcd's token for `auth`, "" until authenticated
        self._current = 0  # the endpoint that answered last
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=16, ssl=self._ssl_context if self._ssl_context else True)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    async def _headers(self) -> dict[str, str]:
        if self._auth is None:
            return {}
        if not self._token:
            reply = await self._post("/v3/auth/authenticate",
                                     {"name": self._auth.username, "password": self._auth.password}, None, {})
            self._token = str(reply.get("token", ""))
            if not self._token:
                raise EtcdError(f"etcd authenticated {self._auth.username!r} without a token", _UNAUTHENTICATED)
        return {"Authorization": self._token}

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def call(self, path: str, body: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """POST `body` to `path` on each endpoint in turn; the decoded reply, EtcdError or EtcdUnavailable. With
        `auth`, a token etcd refuses is got again once."""
        try:
            return await self._post(path, body, timeout_s, await self._headers())
        except EtcdError as exc:
            if self._auth is None or exc.code != _UNAUTHENTICATED or not self._token:
                raise
            self._token = ""
            return await self._post(path, body, timeout_s, await self._headers())

    async def _post(self, path: str, body: dict[str, Any], timeout_s: float | None,
                    headers: dict[str, str]) -> dict[str, Any]:
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.call_timeout_s)
        failures: list[str] = []
        for attempt in range(len(self.endpoints)):
            index = (self._current + attempt) % len(self.endpoints)
            try:
                async with self._http().post(self.endpoints[index] + path, json=body, timeout=timeout,
                                             headers=headers) as response:
                    reply = await response.json(content_type=None)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                failures.append(f"{self.endpoints[index]}: {type(exc).__name__} {exc}".rstrip())
                continue
            self._current = index
            return _checked(reply, path)
        raise EtcdUnavailable("etcd unreachable (" + "; ".join(failures) + ")")

    # ---- keys -------------------------------------------------------------------------------------------
    async def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        reply = await self.call("/v3/kv/put", {"key": _b64(key), "value": _b64(value), "lease": str(lease)})
        return int(reply.get("header", {}).get("revision", 0))

    async def get_prefix(self, prefix: bytes) -> tuple[list[KeyValue], int]:
        """Every key under `prefix` (oldest creation first) and the store revision they were read at."""
        reply = await self.call("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)),
                                                 "sort_target": "CREATE", "sort_order": "ASCEND"})
        return [_kv(kv) for kv in reply.get("kvs", [])], int(reply.get("header", {}).get("revision", 0))

    async def delete(self, key: bytes) -> int:
        reply = await self.call("/v3/kv/deleterange", {"key": _b64(key)})
        return int(reply.get("deleted", 0))

    async def put_if_absent(self, key: bytes, value: bytes, lease: int) -> bool:
        """Create `key` only if it does not exist (a transaction on its create revision); True if created."""
        reply = await self.call("/v3/kv/txn", {
            "compare": [{"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
            "success": [{"request_put": {"key": _b64(key), "value": _b64(value), "lease": str(lease)}}]})
        return bool(reply.get("succeeded", False))

    # ---- leases -----------------------------------------------------------------------------------------
    async def grant(self, ttl_s: int) -> int:
        reply = await self.call("/v3/lease/grant", {"TTL": str(ttl_s)})
        lease_id = int(reply.get("ID", 0))
        if not lease_id:
            raise EtcdError(f"lease grant returned no id: {reply}")
        return lease_id

    async def keepalive(self, lease_id: int) -> int:
        """One keep-alive; the lease's remaining TTL in seconds, 0 when it no longer exists."""
        reply = await self.call("/v3/lease/keepalive", {"ID": str(lease_id)})
        return int(reply.get("result", {}).get("TTL", 0))

    async def revoke(self, lease_id: int) -> None:
        """Revoke the lease (its keys go at once); a lease that is already gone is no error."""
        try:
            await self.call("/v3/lease/revoke", {"ID": str(lease_id)})
        except EtcdError as exc:
            if exc.code != 5:  # NotFound: already expired
                raise

    # ---- watches ----------------------------------------------------------------------------------------
    async def watch_prefix(self, prefix: bytes, start_revision: int, idle_s: float) -> AsyncIterator[list[WatchEvent]]:
        """Events under `prefix` from `start_revision` on, one list per etcd reply; ends after `idle_s` quiet."""
        body = {"create_request": {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)),
                                   "start_revision": str(start_revision)}}
        timeout = aiohttp.ClientTimeout(total=None, connect=self.call_timeout_s, sock_read=idle_s)
        endpoint = self.endpoints[self._current]
        headers = await self._headers()
        try:
            async with self._http().post(endpoint + "/v3/watch", json=body, timeout=timeout,
                                         headers=headers) as response:
                async for line in response.content:
                    events = _watch_events(json.loads(line), start_revision) if line.strip() else []
                    if events:  # the first reply (created) and progress replies carry none
                        yield events
        except asyncio.TimeoutError:
            return  # idle: the caller reopens from the last revision it saw
        except (aiohttp.ClientError, ValueError) as exc:
            self._current = (self._current + 1) % len(self.endpoints)
            raise EtcdUnavailable(f"etcd watch on {endpoint} broke: {type(exc).__name__} {exc}".rstrip()) from None
        except EtcdError as exc:
            if exc.code == _UNAUTHENTICATED:
                self._token = ""  # the next call gets a fresh one
            raise


def _checked(reply: Any, path: str) -> dict[str, Any]:
    if not isinstance(reply, dict):
        raise EtcdError(f"etcd {path}: unexpected reply {reply!r:.200}")
    if "error" in reply or ("code" in reply and "message" in reply):
        raise EtcdError(f"etcd {path}: {reply.get('message') or reply.get('error')}", int(reply.get("code", 0)))
    return reply


def _watch_events(message: Any, start_revision: int) -> list[WatchEvent]:
    if not isinstance(message, dict) or "result" not in message:
        error = message.get("error", message) if isinstance(message, dict) else message
        code = error.get("grpc_code", 0) if isinstance(error, dict) else 0
        text = error.get("message", error) if isinstance(error, dict) else error
        if code == 14 or "closing" in str(text):  # UNAVAILABLE: etcd is shutting down or lost its quorum
            raise EtcdUnavailable(f"etcd unreachable (watch: {text})")
        raise EtcdError(f"etcd watch: {text!r:.200}", int(code))
    result = message["result"]
    if int(result.get("compact_revision", 0)) > 0:
        raise WatchCompacted(f"etcd watch: revision {start_revision} was compacted "
                             f"(oldest kept {result['compact_revision']})")
    if result.get("canceled"):
        raise EtcdError(f"etcd watch canceled: {result.get('cancel_reason', 'no reason given')}")
    return [WatchEvent("delete" if e.get("type") == "DELETE" else "put", _kv(e.get("kv", {})))
            for e in result.get("events", [])]
