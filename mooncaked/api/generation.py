"""Serving one completion or chat-completion request from a backend, streamed or aggregated.

1. `serve_generation` runs the request in its own task and watches the connection; a client that goes away
   cancels that task, which closes the backend's iterator at once (the backend then frees the request).
2. The task calls `backend.prepare`, then reads `backend.generate` chunk by chunk; each wait has the
   no-progress deadline `timeout_s` (504 past it). A completion of several prompts is one backend request per
   prompt, prepared in order and generated side by side; their chunks are merged as they come, each renumbered
   to its prompt's choice (`merge_choices`).
3. Streaming: the first chunk is awaited before the 200 headers go out, so an error up to then is a plain
   HTTP error; later errors become a final `data: {"error": ...}` event, then `data: [DONE]`. Every write has
   the same no-progress deadline: a client that stops reading is cut off (its connection aborted), which ends
   the request and frees its tenant's concurrency slot. Not streaming: chunks are aggregated into one JSON
   response.
4. The backend's iterator is always closed (`aclose`) when reading stops, whatever the reason.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, MutableMapping, Sequence
from typing import Any

from aiohttp import web

from mooncaked.api.backend import GenerationBackend, GenerationChunk
from mooncaked.api.errors import ApiError, deadline_exceeded, internal_error
from mooncaked.api.requests import ChatRequest, CompletionRequest
from mooncaked.api.responses import ResponseBuilder
from mooncaked.api.sse import DONE_EVENT, encode_event, start_event_stream

logger = logging.getLogger(__name__)

# Connection loss is seen by polling the transport: aiohttp has no public hook for it when handler
# cancellation is off (its default); 0.1 s keeps cancellation prompt at a negligible cost per request.
DISCONNECT_POLL_S = 0.1
CLIENT_CLOSED_STATUS = 499


class RequestLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """Prefixes every line with the request id."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        assert self.extra is not None
        return f"[{self.extra['request_id']}] {msg}", kwargs


def request_log(request_id: str, base: logging.Logger = logger) -> RequestLog:
    return RequestLog(base, {"request_id": request_id})


async def serve_generation(
    http_request: web.Request,
    api_requests: Sequence[CompletionRequest | ChatRequest],
    backend: GenerationBackend,
    *,
    timeout_s: float,
    request_id: str,
) -> web.StreamResponse:
    log = request_log(request_id)
    work = asyncio.ensure_future(_generate(http_request, api_requests, backend, timeout_s, log, request_id))
    gone = asyncio.ensure_future(_wait_disconnect(http_request))
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            log.info("client disconnected: cancelling the request")
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    if work.cancelled():
        return web.Response(status=CLIENT_CLOSED_STATUS)
    return work.result()


async def _wait_disconnect(http_request: web.Request) -> None:
    while http_request.transport is not None and not http_request.transport.is_closing():
        await asyncio.sleep(DISCONNECT_POLL_S)


async def _generate(
    http_request: web.Request,
    api_requests: Sequence[CompletionRequest | ChatRequest],
    backend: GenerationBackend,
    timeout_s: float,
    log: RequestLog,
    request_id: str,
) -> web.StreamResponse:
    prepared = []
    try:
        async with asyncio.timeout(timeout_s):
            for api_request in api_requests:
                prepared.append(await backend.prepare(api_request))
    except TimeoutError:
        raise deadline_exceeded(f"The request was not admitted within {timeout_s:g} s; retry later.") from None
    log.debug("prepared: %d prompt tokens, max_tokens %d", prepared[0].num_prompt_tokens, prepared[0].max_tokens)
    streams = [backend.generate(p) for p in prepared]
    n = api_requests[0].n
    chunks = streams[0] if len(streams) == 1 else merge_choices(streams, n)
    builder = ResponseBuilder(api_requests[0], num_choices=len(streams) * n, choices_per_prompt=n,
                              response_id=request_id)
    try:
        if api_request.stream:
            return await _stream(http_request, chunks, builder, timeout_s, log)
        return await _aggregate(chunks, builder, timeout_s)
    finally:
        await _close(chunks)


async def _next_chunk(chunks: AsyncIterator[GenerationChunk], timeout_s: float) -> GenerationChunk:
    try:
        async with asyncio.timeout(timeout_s):
            return await anext(chunks)
    except TimeoutError:
        raise deadline_exceeded(f"No output for {timeout_s:g} s; the request was abandoned.") from None
    except StopAsyncIteration:
        raise internal_error("The backend ended the output without a finish reason.") from None


async def _aggregate(
    chunks: AsyncIterator[GenerationChunk], builder: ResponseBuilder, timeout_s: float
) -> web.Response:
    headers = {"X-Request-Id": builder.request_id}
    while not builder.is_done:
        chunk = await _next_chunk(chunks, timeout_s)
        if builder.num_completion_tokens == 0:
            headers.update(chunk.prediction_headers())
        builder.add(chunk)
    return web.json_response(builder.final_response(), headers=headers)


async def _stream(
    http_request: web.Request,
    chunks: AsyncIterator[GenerationChunk],
    builder: ResponseBuilder,
    timeout_s: float,
    log: RequestLog,
) -> web.StreamResponse:
    chunk = await _next_chunk(chunks, timeout_s)
    response = await start_event_stream(http_request, request_id=builder.request_id,
                                        extra_headers=chunk.prediction_headers())
    try:
        await _relay(response, chunk, chunks, builder, timeout_s)
        await _write(response, DONE_EVENT, timeout_s)
        async with asyncio.timeout(timeout_s):
            await response.write_eof()
    except ClientNotReading as stalled:
        log.warning("%s after %d tokens: the connection is aborted", stalled, builder.num_completion_tokens)
        if http_request.transport is not None:
            http_request.transport.abort()
    except (ConnectionError, TimeoutError):
        log.info("client disconnected mid-stream after %d tokens", builder.num_completion_tokens)
    return response


class ClientNotReading(ConnectionError):
    """The client took none of a streamed event within the no-progress deadline."""


async def _write(response: web.StreamResponse, data: bytes, timeout_s: float) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            await response.write(data)
    except TimeoutError:
        raise ClientNotReading(f"the client read nothing for {timeout_s:g} s") from None


async def _relay(
    response: web.StreamResponse,
    chunk: GenerationChunk,
    chunks: AsyncIterator[GenerationChunk],
    builder: ResponseBuilder,
    timeout_s: float,
) -> None:
    log = request_log(builder.request_id)
    try:
        while True:
            await _write(response, encode_event(builder.add(chunk)), timeout_s)
            if builder.is_done:
                break
            chunk = await _next_chunk(chunks, timeout_s)
    except ApiError as error:
        log.warning("error after %d streamed tokens: %r", builder.num_completion_tokens, error)
        await _write(response, encode_event(error.to_json()), timeout_s)
        return
    except ConnectionError:
        raise
    except Exception:
        log.exception("backend failed mid-stream")
        await _write(response, encode_event(internal_error("The backend failed mid-stream.").to_json()), timeout_s)
        return
    log.info("finished: %s, %d tokens", builder.finish_reason, builder.num_completion_tokens)
    if builder.request.include_usage:
        await _write(response, encode_event(builder.usage_chunk()), timeout_s)


async def merge_choices(streams: Sequence[AsyncIterator[GenerationChunk]],
                        choices_per_stream: int) -> AsyncIterator[GenerationChunk]:
    """Chunks of several requests as they come, stream i's choice j renumbered to i * choices_per_stream + j.
    One task per stream feeds a queue; the first error ends the merge; closing it cancels the tasks and closes
    every stream."""
    queue: asyncio.Queue[tuple[int, GenerationChunk | BaseException | None]] = asyncio.Queue()

    async def feed(index: int, stream: AsyncIterator[GenerationChunk]) -> None:
        try:
            async for chunk in stream:
                await queue.put((index, dataclasses.replace(chunk, index=index * choices_per_stream + chunk.index)))
            await queue.put((index, None))
        except Exception as exc:
            await queue.put((index, exc))
        finally:
            await _close(stream)

    tasks = [asyncio.ensure_future(feed(i, stream)) for i, stream in enumerate(streams)]
    try:
        num_open = len(tasks)
        while num_open:
            _, item = await queue.get()
            if item is None:
                num_open -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _close(chunks: AsyncIterator[GenerationChunk]) -> None:
    aclose = getattr(chunks, "aclose", None)
    if aclose is not None:
        await aclose()
