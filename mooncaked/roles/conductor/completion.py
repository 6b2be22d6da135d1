"""One request served to its end inside the conductor, for context caches and batch lines (no HTTP client).

1. `complete(backend, request, timeout_s)`: prepare, then (`complete_prepared`) read every chunk (each wait
   bounded by `timeout_s`, as the HTTP routes bound theirs) into a `ResponseBuilder`.
2. The iterator is always closed, so the request's legs are settled (an owed DECODE runs to its end and commits
   the prompt's blocks on the decode host) before this returns.
3. The answer is the non-streaming response body, exactly what the HTTP route would have sent.
"""

from __future__ import annotations

import asyncio
from typing import Any

from mooncaked.api.backend import GenerationBackend, PreparedRequest
from mooncaked.api.errors import deadline_exceeded, internal_error
from mooncaked.api.requests import ChatRequest, CompletionRequest
from mooncaked.api.responses import ResponseBuilder
from mooncaked.runtime.aio import aclose


async def complete(backend: GenerationBackend, request: CompletionRequest | ChatRequest,
                   timeout_s: float) -> dict[str, Any]:
    try:
        async with asyncio.timeout(timeout_s):
            prepared = await backend.prepare(request)
    except TimeoutError:
        raise deadline_exceeded(f"The request was not admitted within {timeout_s:g} s.") from None
    return await complete_prepared(backend, prepared, timeout_s)


async def complete_prepared(backend: GenerationBackend, prepared: PreparedRequest, timeout_s: float) -> dict[str, Any]:
    chunks = backend.generate(prepared)
    builder = ResponseBuilder(prepared.request, num_choices=prepared.request.n, choices_per_prompt=prepared.request.n)
    try:
        while not builder.is_done:
            try:
                async with asyncio.timeout(timeout_s):
                    chunk = await anext(chunks)
            except TimeoutError:
                raise deadline_exceeded(f"No output for {timeout_s:g} s; the request was abandoned.") from None
            except StopAsyncIteration:
                raise internal_error("The backend ended the output without a finish reason.") from None
            builder.add(chunk)
    finally:
        await aclose(chunks)
    return builder.final_response()
