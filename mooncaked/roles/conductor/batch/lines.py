"""The lines of a Batch API input file, and the lines of its output and error files (OpenAI's formats).

1. `parse_line(raw, number, endpoint, ...)` validates one input line up front: JSON object, a non-empty
   `custom_id` (unique within the file: `parse_input` checks), `method` POST, `url` equal to the batch's
   endpoint, and a `body` the completion route itself accepts (`stream` is refused: a batch answers whole).
   A bad line is a `LineError` that names what is wrong; it goes to the error file, the rest run.
2. `output_line` (a 200 answer) and `error_line` (a request that failed, or a line that never ran: invalid,
   expired) are the JSON objects of the output and error files.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mooncaked.api.errors import ApiError
from mooncaked.api.requests import ChatRequest, CompletionRequest, parse_chat_request, parse_completion_request
from mooncaked.api.tenants import Tenant

CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"
ENDPOINTS = (CHAT_ENDPOINT, COMPLETIONS_ENDPOINT)
MAX_CUSTOM_ID_CHARS = 512


@dataclass(frozen=True)
class BatchLine:
    number: int  # 1-based line number in the input file
    custom_id: str
    request: CompletionRequest | ChatRequest  # is_batch set: the batch class


@dataclass(frozen=True)
class LineError:
    number: int
    custom_id: str | None
    code: str
    message: str
    param: str | None = None


def parse_input(data: bytes, *, batch_id: str, endpoint: str, model_ids: Sequence[str],
                client_id: str, tenant: Tenant | None = None) -> list[BatchLine | LineError]:
    """Every non-blank line of the file, valid or not, in order."""
    parsed: list[BatchLine | LineError] = []
    seen: set[str] = set()
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        line = parse_line(raw, number, batch_id=batch_id, endpoint=endpoint, model_ids=model_ids,
                          client_id=client_id, tenant=tenant)
        if isinstance(line, BatchLine) and line.custom_id in seen:
            line = LineError(number, line.custom_id, "duplicate_custom_id",
                             f"line {number}: custom_id {line.custom_id!r} is used by an earlier line; "
                             "each line needs its own", "custom_id")
        if isinstance(line, BatchLine):
            seen.add(line.custom_id)
        parsed.append(line)
    return parsed


def parse_line(raw: bytes, number: int, *, batch_id: str, endpoint: str, model_ids: Sequence[str],
               client_id: str, tenant: Tenant | None = None) -> BatchLine | LineError:
    try:
        line = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return LineError(number, None, "invalid_json", f"line {number} is not valid JSON: {exc}")
    if not isinstance(line, dict):
        return LineError(number, None, "invalid_request", f"line {number} must be a JSON object")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID_CHARS:
        return LineError(number, None, "invalid_request",
                         f"line {number}: custom_id must be a string of 1 to {MAX_CUSTOM_ID_CHARS} characters",
                         "custom_id")
    problem = _envelope_problem(line, endpoint)
    if problem:
        return LineError(number, custom_id, "invalid_request", f"line {number}: {problem[1]}", problem[0])
    body = line["body"]
    if body.get("stream"):
        return LineError(number, custom_id, "invalid_request",
                         f"line {number}: body.stream must be false: a batch line is answered whole", "body.stream")
    request_id = f"{batch_id}-{number}"
    try:
        if endpoint == CHAT_ENDPOINT:
            request: CompletionRequest | ChatRequest = parse_chat_request(
                body, request_id=request_id, model_ids=model_ids, client_id=client_id, tenant=tenant)
        else:
            request = parse_completion_request(body, request_id=request_id, model_ids=model_ids, client_id=client_id,
                                               tenant=tenant)
    except ApiError as error:
        param = f"body.{error.param}" if error.param else "body"
        return LineError(number, custom_id, error.code or "invalid_request", f"line {number}: {error.message}",
                         param)
    return BatchLine(number, custom_id, dataclasses.replace(request, is_batch=True))


def _envelope_problem(line: dict[str, Any], endpoint: str) -> tuple[str, str] | None:
    if line.get("method") != "POST":
        return "method", f"method must be \"POST\", got {line.get('method')!r}"
    if line.get("url") != endpoint:
        return "url", f"url must be the batch's endpoint {endpoint!r}, got {line.get('url')!r}"
    if not isinstance(line.get("body"), dict):
        return "body", "body must be a JSON object: the request of the endpoint"
    return None


def output_line(line: BatchLine, body: dict[str, Any]) -> dict[str, Any]:
    return {"id": _line_id(), "custom_id": line.custom_id,
            "response": {"status_code": 200, "request_id": line.request.request_id, "body": body}, "error": None}


def failed_line(line: BatchLine, error: ApiError) -> dict[str, Any]:
    """A request that ran and failed: the error file carries the HTTP answer it got."""
    return {"id": _line_id(), "custom_id": line.custom_id,
            "response": {"status_code": error.status, "request_id": line.request.request_id, "body": error.to_json()},
            "error": None}


def error_line(error: LineError) -> dict[str, Any]:
    """A line that never ran (invalid, or left when the batch expired)."""
    return {"id": _line_id(), "custom_id": error.custom_id, "response": None,
            "error": {"code": error.code, "message": error.message, "param": error.param, "line": error.number}}


def _line_id() -> str:
    return "batch_req_" + uuid.uuid4().hex[:24]
