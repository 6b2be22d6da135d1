"""OpenAI-style API errors: one exception type, its JSON body and its HTTP response.

1. Request parsing, the backend and the app raise `ApiError` with an HTTP status, a message that says what to
   do, and (for bad input) the field at fault in `param`.
2. The app turns it into `{"error": {"message", "type", "param", "code"}}` with that status; a 429 carries a
   `Retry-After` header; after an SSE stream began the same body is sent as a final `data:` event.
"""

from __future__ import annotations

import json
import math
from typing import Any

from aiohttp import web

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
    504: "server_error",
}


class ApiError(Exception):
    """An error the HTTP layer reports to the client with `status` and OpenAI's error JSON."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def to_json(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __repr__(self) -> str:
        return f"ApiError({self.status}, {self.message!r}, param={self.param!r}, code={self.code!r})"


def invalid_field(param: str, message: str) -> ApiError:
    """400 for a bad request field; the message names the field."""
    return ApiError(400, f"{param}: {message}", param=param)


def model_not_found(model: str) -> ApiError:
    return ApiError(
        404, f"The model `{model}` does not exist; GET /v1/models lists the served models.",
        param="model", code="model_not_found",
    )


def unauthorized() -> ApiError:
    return ApiError(
        401, "Incorrect or missing API key: send it as `Authorization: Bearer <key>`.", code="invalid_api_key"
    )


def text_too_long(num_chars: int, max_chars: int, max_model_len: int, param: str) -> ApiError:
    """413 for text so long that no tokenization of it fits the model's context (refused before tokenizing)."""
    return ApiError(
        413,
        f"The {param} has {num_chars} characters: far more than this model's maximum context length of "
        f"{max_model_len} tokens can hold (at most {max_chars} characters); shorten it.",
        param=param, code="context_length_exceeded",
    )


def context_too_long(num_prompt_tokens: int, max_model_len: int) -> ApiError:
    """413 for a prompt that leaves no room in the model's context."""
    return ApiError(
        413,
        f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
        f"{num_prompt_tokens} tokens; shorten the prompt or lower max_tokens.",
        param="prompt", code="context_length_exceeded",
    )


def overloaded(reason: str, retry_after_s: float) -> ApiError:
    """429 early rejection: the cluster cannot serve the request within its SLOs now."""
    return ApiError(
        429, f"The server is overloaded ({reason}); retry after {retry_after_s:.1f} s.",
        code="rate_limit_exceeded", retry_after_s=retry_after_s,
    )


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, code="service_unavailable")


def deadline_exceeded(message: str) -> ApiError:
    return ApiError(504, message, code="timeout")


def internal_error(message: str) -> ApiError:
    return ApiError(500, message, code="internal_error")


def retry_after_header(retry_after_s: float) -> str:
    """HTTP `Retry-After` takes whole seconds: round up so a client never retries early."""
    return str(max(0, math.ceil(retry_after_s)))


def error_response(error: ApiError, *, request_id: str | None = None) -> web.Response:
    headers = {}
    if error.retry_after_s is not None:
        headers["Retry-After"] = retry_after_header(error.retry_after_s)
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    return web.Response(
        status=error.status, text=json.dumps(error.to_json()), content_type="application/json", headers=headers
    )
