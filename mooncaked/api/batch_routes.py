"""HTTP routes of the Files and Batch APIs (OpenAI's): /v1/files and /v1/batches.

1. `add_batch_routes(app, files, service, ...)` adds the routes to the app `create_app` built (its middlewares,
   request ids, OpenAI error JSON and API keys apply); without `conductor.batch_dir` the conductor adds
   `add_disabled_routes` instead, which answer 404 naming the option.
2. POST /v1/files reads the multipart body as a stream (the app's body limit does not apply to it): the `file`
   part goes to disk chunk by chunk, bounded by `max_file_bytes` (413 past it), `purpose` must be "batch".
   GET /v1/files[?purpose=], GET /v1/files/{id}, GET /v1/files/{id}/content, DELETE /v1/files/{id}.
3. POST /v1/batches parses `input_file_id`, `endpoint`, `completion_window` and `metadata` into a `BatchCreate`;
   GET /v1/batches[?limit=&after=], GET /v1/batches/{id}, POST /v1/batches/{id}/cancel go to the `BatchService`
   (the conductor's batch manager). Everything is scoped to the caller's API key.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import BodyPartReader, web

from mooncaked.api.app import CLIENT_ID_KEY, TENANT_KEY, read_body_step, read_request_body
from mooncaked.api.errors import ApiError, invalid_field
from mooncaked.api.fields import json_type, read_str
from mooncaked.api.file_store import FileStore, file_too_large
from mooncaked.api.requests import decode_json_body

BATCH_ID_PATTERN = re.compile(r"^batch_[0-9a-f]{32}$")
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
COMPLETION_WINDOWS = ("24h",)
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's limits
MULTIPART_SLACK_BYTES = 64 << 10  # headers and boundaries around the file part
MAX_FIELD_BYTES = 1024  # a multipart form field other than the file


@dataclass(frozen=True)
class BatchCreate:
    owner: str
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None
    tenant_id: str = ""  # the creator's tenant ("" without tenants)


class BatchService(Protocol):
    async def create_batch(self, spec: BatchCreate) -> dict[str, Any]: ...

    def get_batch(self, batch_id: str, owner: str) -> dict[str, Any]: ...

    def list_batches(self, owner: str, limit: int, after: str | None) -> tuple[list[dict[str, Any]], bool]: ...

    async def cancel_batch(self, batch_id: str, owner: str) -> dict[str, Any]: ...


def batch_not_found(batch_id: str) -> ApiError:
    return ApiError(404, f"No batch with id {batch_id!r}: GET /v1/batches lists the batches of this API key.",
                    param="batch_id", code="not_found")


def parse_batch_create(body: dict[str, Any], owner: str) -> BatchCreate:
    input_file_id = read_str(body, "input_file_id")
    if not input_file_id:
        raise invalid_field("input_file_id", "the id of a file uploaded with purpose \"batch\" is required")
    endpoint = read_str(body, "endpoint")
    if endpoint not in ENDPOINTS:
        raise invalid_field("endpoint", f"must be one of {list(ENDPOINTS)}, got {endpoint!r}")
    window = read_str(body, "completion_window")
    if window not in COMPLETION_WINDOWS:
        raise invalid_field("completion_window", f"must be one of {list(COMPLETION_WINDOWS)}, got {window!r}")
    return BatchCreate(owner, input_file_id, endpoint, window, _read_metadata(body.get("metadata")))


def _read_metadata(metadata: object) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise invalid_field("metadata", f"expected an object of strings, got {json_type(metadata)}")
    if len(metadata) > MAX_METADATA_PAIRS:
        raise invalid_field("metadata", f"at most {MAX_METADATA_PAIRS} pairs, got {len(metadata)}")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or not isinstance(value, str) or len(value) > MAX_METADATA_VALUE:
            raise invalid_field("metadata", f"keys of at most {MAX_METADATA_KEY} characters with string values of "
                                f"at most {MAX_METADATA_VALUE}; {key[:80]!r} is not")
    return dict(metadata)


class BatchRoutes:
    """Request handlers; holds no per-request state."""

    def __init__(self, files: FileStore, service: BatchService, max_file_bytes: int) -> None:
        self.files = files
        self.service = service
        self.max_file_bytes = max_file_bytes

    # ---- files -------------------------------------------------------------------------------------------
    async def upload(self, request: web.Request) -> web.Response:
        if request.content_length is not None and request.content_length > self.max_file_bytes + \
                MULTIPART_SLACK_BYTES:
            raise file_too_large(self.max_file_bytes)
        if not request.content_type.startswith("multipart/"):
            raise ApiError(400, "POST /v1/files takes multipart/form-data with a `file` and a `purpose` field.")
        file_id, num_bytes, filename, purpose = self.files.new_id(), -1, "", None
        try:
            reader = await request.multipart()
            while (part := await read_body_step(request, reader.next())) is not None:
                if not isinstance(part, BodyPartReader):
                    raise ApiError(400, "nested multipart bodies are not supported")
                steady = _SteadyPart(request, part)
                if part.name == "file" and num_bytes < 0:
                    filename = (part.filename or "upload.jsonl")[:255]
                    num_bytes = await self.files.receive(steady, file_id, self.max_file_bytes)
                elif part.name == "purpose":
                    purpose = (await _read_field(steady, part.name)).strip()
                else:
                    await _read_field(steady, part.name)
            if num_bytes < 0:
                raise invalid_field("file", "the multipart body has no `file` part")
            if purpose != "batch":
                raise invalid_field("purpose", f"must be \"batch\" (the only purpose served), got {purpose!r}")
        except BaseException:
            self.files.discard(file_id)
            raise
        info = self.files.commit_upload(file_id, filename, purpose, _owner(request), num_bytes)
        return web.json_response(info.as_json())

    async def list_files(self, request: web.Request) -> web.Response:
        infos = self.files.list(_owner(request), request.query.get("purpose"))
        return web.json_response({"object": "list", "data": [i.as_json() for i in infos], "has_more": False})

    async def get_file(self, request: web.Request) -> web.Response:
        return web.json_response(self.files.get(request.match_info["file_id"], _owner(request)).as_json())

    async def file_content(self, request: web.Request) -> web.StreamResponse:
        path = self.files.data_path(request.match_info["file_id"], _owner(request))
        return web.FileResponse(path, headers={"Content-Type": "application/octet-stream"})

    async def delete_file(self, request: web.Request) -> web.Response:
        file_id = request.match_info["file_id"]
        self.files.delete(file_id, _owner(request))
        return web.json_response({"id": file_id, "object": "file", "deleted": True})

    # ---- batches -----------------------------------------------------------------------------------------
    async def create_batch(self, request: web.Request) -> web.Response:
        spec = parse_batch_create(decode_json_body(await read_request_body(request)), _owner(request))
        tenant = request.get(TENANT_KEY)
        spec = dataclasses.replace(spec, tenant_id=tenant.id if tenant is not None else "")
        return web.json_response(await self.service.create_batch(spec))

    async def list_batches(self, request: web.Request) -> web.Response:
        limit = _query_int(request, "limit", 20, 1, 100)
        data, has_more = self.service.list_batches(_owner(request), limit, request.query.get("after"))
        return web.json_response({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                                  "last_id": data[-1]["id"] if data else None, "has_more": has_more})

    async def get_batch(self, request: web.Request) -> web.Response:
        return web.json_response(self.service.get_batch(_batch_id(request), _owner(request)))

    async def cancel_batch(self, request: web.Request) -> web.Response:
        return web.json_response(await self.service.cancel_batch(_batch_id(request), _owner(request)))


def add_batch_routes(app: web.Application, files: FileStore, service: BatchService, max_file_bytes: int) -> None:
    routes = BatchRoutes(files, service, max_file_bytes)
    app.router.add_post("/v1/files", routes.upload)
    app.router.add_get("/v1/files", routes.list_files)
    app.router.add_get("/v1/files/{file_id}", routes.get_file)
    app.router.add_get("/v1/files/{file_id}/content", routes.file_content)
    app.router.add_delete("/v1/files/{file_id}", routes.delete_file)
    app.router.add_post("/v1/batches", routes.create_batch)
    app.router.add_get("/v1/batches", routes.list_batches)
    app.router.add_get("/v1/batches/{batch_id}", routes.get_batch)
    app.router.add_post("/v1/batches/{batch_id}/cancel", routes.cancel_batch)


def add_disabled_routes(app: web.Application) -> None:
    async def disabled(request: web.Request) -> web.Response:
        raise ApiError(404, "The Files and Batch APIs are off on this conductor: set conductor.batch_dir.",
                       code="not_found")

    for path in ("/v1/files", "/v1/files/{tail:.*}", "/v1/batches", "/v1/batches/{tail:.*}"):
        app.router.add_route("*", path, disabled)


class _SteadyPart:
    """A multipart part whose every chunk must arrive within the body's no-progress deadline (read_body_step)."""

    def __init__(self, request: web.Request, part: BodyPartReader) -> None:
        self.request = request
        self.part = part

    async def next_chunk(self, size: int) -> bytes:
        return await read_body_step(self.request, self.part.read_chunk(size))


async def _read_field(part: _SteadyPart, name: str | None) -> str:
    data = bytearray()
    while chunk := await part.next_chunk(MAX_FIELD_BYTES):
        data += chunk
        if len(data) > MAX_FIELD_BYTES:
            raise invalid_field(name or "form", f"a form field may hold at most {MAX_FIELD_BYTES} bytes")
    return data.decode("utf-8", errors="replace")


def _owner(request: web.Request) -> str:
    return request.get(CLIENT_ID_KEY, "")


def _batch_id(request: web.Request) -> str:
    batch_id = request.match_info["batch_id"]
    if not BATCH_ID_PATTERN.match(batch_id):
        raise batch_not_found(batch_id[:80])
    return batch_id


def _query_int(request: web.Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    if not raw.isdigit() or not lo <= int(raw) <= hi:
        raise invalid_field(name, f"must be an integer in {lo}..{hi}, got {raw[:20]!r}")
    return int(raw)
