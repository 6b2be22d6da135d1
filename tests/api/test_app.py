"""The HTTP layer end to end: the real aiohttp app on loopback in front of a scripted backend."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from mooncaked.api.app import create_app
from tests.api.scripted_backend import MODEL_ID, ScriptedBackend

MakeClient = Callable[..., Awaitable[TestClient[web.Request, web.Application]]]


@pytest.fixture
async def make_client() -> AsyncIterator[MakeClient]:
    clients: list[TestClient[web.Request, web.Application]] = []

    async def make(
        backend: ScriptedBackend, *, api_keys: frozenset[str] = frozenset(), max_body_bytes: int = 1 << 20,
        request_timeout_s: float = 5.0,
    ) -> TestClient[web.Request, web.Application]:
        app = create_app(backend, api_keys=api_keys, max_body_bytes=max_body_bytes,
                         request_timeout_s=request_timeout_s)
        client = TestClient(TestServer(app, host="127.0.0.1"))
        await client.start_server()
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


def parse_events(body: str) -> list[Any]:
    events = []
    for block in body.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def test_completion_not_streamed(make_client: MakeClient) -> None:
    client = await make_client(ScriptedBackend())
    response = await client.post(
        "/v1/completions", json={"model": MODEL_ID, "prompt": "hello", "max_tokens": 3},
        headers={"X-Request-Id": "req-42"},
    )
    assert response.status == 200
    assert response.headers["X-Request-Id"] == "req-42"
    body = await response.json()
    assert body["id"] == "cmpl-req-42"
    assert body["object"] == "text_completion"
    assert body["model"] == MODEL_ID
    assert body["choices"] == [{"index": 0, "text": " t0 t1 t2", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {
        "prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8, "prompt_tokens_details": {"cached_tokens": 2},
    }


async def test_completion_streamed_with_usage(make_client: MakeClient) -> None:
    backend = ScriptedBackend()
    client = await make_client(backend)
    response = await client.post("/v1/completions", json={
        "prompt": [1, 2, 3, 4], "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True},
    })
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/event-stream")
    events = parse_events(await response.text())
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:3], events[3]
    assert [c["choices"][0]["text"] for c in chunks] == [" t0", " t1", " t2"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert all(c["object"] == "text_completion" and c["id"].startswith("cmpl-") for c in chunks)
    assert all(c["usage"] is None for c in chunks)
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["prompt_tokens"] == 4
    assert usage_chunk["usage"]["completion_tokens"] == 3
    assert usage_chunk["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    assert len({c["id"] for c in events[:-1]}) == 1
    assert backend.cancelled == set() and len(backend.closed) == 1


async def test_chat_streamed_and_not(make_client: MakeClient) -> None:
    client = await make_client(ScriptedBackend())
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    response = await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2,
                                                               "stream": True})
    events = parse_events(await response.text())
    assert events[-1] == "[DONE]" and len(events) == 3
    first, second = events[0], events[1]
    assert first["object"] == "chat.completion.chunk" and first["id"].startswith("chatcmpl-")
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": " t0"}
    assert second["choices"][0]["delta"] == {"content": " t1"}
    assert second["choices"][0]["finish_reason"] == "length"
    assert "usage" not in second

    response = await client.post("/v1/chat/completions", json={"messages": messages, "max_completion_tokens": 2})
    body = await response.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": " t0 t1"}
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 2


async def test_logprobs_both_endpoints(make_client: MakeClient) -> None:
    client = await make_client(ScriptedBackend())
    response = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "logprobs": 2})
    logprobs = (await response.json())["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [" t0", " t1"]
    assert logprobs["token_logprobs"] == [-0.25, -0.25]
    assert logprobs["top_logprobs"][0] == {" a0": -0.5, " a1": -1.0}
    assert logprobs["text_offset"] == [0, 3]

    response = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "logprobs": True, "top_logprobs": 1,
        "stream": True,
    })
    content = parse_events(await response.text())[0]["choices"][0]["logprobs"]["content"]
    assert content == [{"token": " t0", "logprob": -0.25, "bytes": list(b" t0"),
                        "top_logprobs": [{"token": " a0", "logprob": -0.5, "bytes": list(b" a0")}]}]


BAD_BODIES = [
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "temperature": 3}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "n": 17}, "n"),
    ({"prompt": "x", "n": 3, "best_of": 2}, "best_of"),
    ({"prompt": "x", "best_of": 3, "stream": True}, "best_of"),
    ({"prompt": "x", "stop": ["a", 1]}, "stop"),
    ({"prompt": "x", "stop": ["s"] * 17}, "stop"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "seed": 1.5}, "seed"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": ["a", 3]}, "prompt"),
    ({"prompt": ["a", ""]}, "prompt[1]"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": 7}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
]


@pytest.mark.parametrize(("body", "param"), BAD_BODIES)
async def test_bad_completion_fields_name_the_field(make_client: MakeClient, body: dict[str, Any],
                                                    param: str) -> None:
    client = await make_client(ScriptedBackend())
    response = await client.post("/v1/completions", json=body)
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert param in error["message"]
    assert set(error) == {"message", "type", "param", "code"}


BAD_CHAT_BODIES = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens"),
]


@pytest.mark.parametrize(("body", "param"), BAD_CHAT_BODIES)
async def test_bad_chat_fields_name_the_field(make_client: MakeClient, body: dict[str, Any], param: str) -> None:
    client = await make_client(ScriptedBackend())
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["param"] == param and param in error["message"]


async def test_malformed_json_and_non_object_bodies(make_client: MakeClient) -> None:
    client = await make_client(ScriptedBackend())
    for data in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        response = await client.post("/v1/completions", data=data, headers={"Content-Type": "application/json"})
        assert response.status == 400
        assert (await response.json())["error"]["type"] == "invalid_request_error"


async def test_unknown_model_and_route(make_client: MakeClient) -> None:
    client = await make_client(ScriptedBackend())
    response = await client.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    assert response.status == 404
    error = (await response.json())["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model" and "gpt-9" in error["message"]
    response = await client.get("/v1/nowhere")
    assert response.status == 404
    assert "error" in await response.json()


async def test_too_large_body_and_prompt(make_client: MakeClient) -> None:
    client = await make_client(ScriptedBackend(max_model_len=16), max_body_bytes=1000)
    response = await client.post("/v1/completions", json={"prompt": "x" * 2000})
    assert response.status == 413
    assert (await response.json())["error"]["code"] == "request_too_large"
    response = await client.post("/v1/completions", json={"prompt": "x" * 100})
    assert response.status == 413
    error = (await response.json())["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"


async def test_backend_rejections_map_to_status(make_client: MakeClient) -> None:
    client = await make_client(ScriptedBackend(), request_timeout_s=0.2)
    response = await client.post("/v1/completions", json={"prompt": "REJECT", "stream": True})
    assert response.status == 429
    assert response.headers["Retry-After"] == "2"
    assert (await response.json())["error"]["type"] == "rate_limit_error"
    response = await client.post("/v1/completions", json={"prompt": "UNAVAILABLE"})
    assert response.status == 503
    response = await client.post("/v1/completions", json={"prompt": "SLOW_PREPARE"})
    assert response.status == 504
    assert (await response.json())["error"]["code"] == "timeout"


async def test_api_keys(make_client: MakeClient) -> None:
    client = await make_client(ScriptedBackend(), api_keys=frozenset({"k1", "k2"}))
    body = {"prompt": "x", "max_tokens": 1}
    assert (await client.post("/v1/completions", json=body)).status == 401
    wrong = await client.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status == 401
    assert (await wrong.json())["error"]["code"] == "invalid_api_key"
    right = await client.post("/v1/completions", json=body, headers={"Authorization": "Bearer k2"})
    assert right.status == 200
    assert (await client.get("/v1/models")).status == 401
    assert (await client.get("/health")).status == 200


async def test_info_routes(make_client: MakeClient) -> None:
    backend = ScriptedBackend()
    client = await make_client(backend)
    models = await (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == [MODEL_ID] and models["object"] == "list"
    assert (await (await client.get("/health")).json())["status"] == "ok"
    await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    metrics = await client.get("/metrics")
    assert metrics.headers["Content-Type"].startswith("text/plain")
    assert "mooncaked_scripted_prepared_total 1" in await metrics.text()
    cluster = await (await client.get("/v1/cluster")).json()
    assert cluster["num_prepared"] == 1


async def test_error_mid_stream_becomes_error_event(make_client: MakeClient) -> None:
    backend = ScriptedBackend()
    client = await make_client(backend)
    for prompt, status_code in (("FAIL_MID", "service_unavailable"), ("BUG", "internal_error")):
        response = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "stream": True,
                                                               "stream_options": {"include_usage": True}})
        assert response.status == 200
        events = parse_events(await response.text())
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == status_code
        assert all("choices" in event for event in events[:-2])
    assert len(backend.closed) == 2


async def test_stall_mid_stream_times_out(make_client: MakeClient) -> None:
    backend = ScriptedBackend()
    client = await make_client(backend, request_timeout_s=0.3)
    response = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "STALL"}], "max_tokens": 4, "stream": True})
    events = parse_events(await response.text())
    assert [e["choices"][0]["delta"]["content"] for e in events[:1]] == [" t0"]
    assert events[1]["error"]["code"] == "timeout" and events[2] == "[DONE]"
    assert backend.cancelled == {response.headers["X-Request-Id"]}


async def _disconnect_mid_stream(base_url: str, backend: ScriptedBackend, *, stream: bool) -> None:
    """Stream: read the first event, then drop the connection. Not streamed: drop it while waiting."""
    body = {"prompt": "STALL", "max_tokens": 4, "stream": stream}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        if stream:
            response = await session.post(f"{base_url}/v1/completions", json=body,
                                          headers={"X-Request-Id": "gone-1"})
            assert (await response.content.readuntil(b"\n\n")).startswith(b"data: ")
            response.close()
        else:
            waiting = asyncio.ensure_future(session.post(f"{base_url}/v1/completions", json=body,
                                                         headers={"X-Request-Id": "gone-1"}))
            await asyncio.sleep(0.2)
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
    await asyncio.wait_for(backend.closed_event.wait(), timeout=2.0)
    assert backend.cancelled == {"gone-1"}


async def test_disconnect_cancels_backend_with_handler_cancellation(make_client: MakeClient) -> None:
    backend = ScriptedBackend()
    client = await make_client(backend)
    await _disconnect_mid_stream(str(client.make_url("")).rstrip("/"), backend, stream=True)


@pytest.mark.parametrize("stream", [True, False])
async def test_disconnect_cancels_backend_under_default_runner(stream: bool) -> None:
    backend = ScriptedBackend()
    app = create_app(backend, api_keys=frozenset(), max_body_bytes=1 << 20, request_timeout_s=30.0)
    runner = web.AppRunner(app)  # aiohttp's default: handlers are not cancelled on disconnect
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        await _disconnect_mid_stream(f"http://127.0.0.1:{port}", backend, stream=stream)
    finally:
        await runner.cleanup()


async def test_a_client_that_stops_reading_a_stream_is_cut_off(make_client: MakeClient) -> None:
    backend = ScriptedBackend(max_model_len=10**7)
    client = await make_client(backend, request_timeout_s=0.5)
    body = json.dumps({"prompt": "x", "max_tokens": 2_000_000, "stream": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        await loop.sock_connect(sock, ("127.0.0.1", client.port))  # type: ignore[arg-type]
        await loop.sock_sendall(sock, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Request-Id: not-reading\r\n"
                                      b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                                % (len(body), body))
        await asyncio.wait_for(backend.closed_event.wait(), 30)  # never reads: the server gives up on it
    finally:
        sock.close()
    assert backend.cancelled == {"not-reading"}
