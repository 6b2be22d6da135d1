"""Server-sent events as OpenAI streams them: `data: <json>\\n\\n` per event, then `data: [DONE]\\n\\n`."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

DONE_EVENT = b"data: [DONE]\n\n"


def encode_event(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


async def start_event_stream(request: web.Request, *, request_id: str,
                             extra_headers: dict[str, str] | None = None) -> web.StreamResponse:
    """Send the 200 headers of an event stream; the body follows event by event."""
    response = web.StreamResponse(
        status=200,
        headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # proxies must not buffer tokens
            "X-Request-Id": request_id,
            **(extra_headers or {}),
        },
    )
    await response.prepare(request)
    return response
