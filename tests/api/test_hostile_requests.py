"""Hostile request bodies, generated: the parsers and the HTTP layer answer every one with a request or a 4xx in
OpenAI's error JSON; never a 500, an unhandled exception, a hang, or harm to the next request."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mooncaked.api.app import create_app
from mooncaked.api.errors import ApiError
from mooncaked.api.requests import decode_json_body, parse_chat_request, parse_completion_request
from tests.api.hostile import encode, mutated_bodies, raw_bodies
from tests.api.scripted_backend import MODEL_ID, ScriptedBackend

PARSERS = {"/v1/completions": parse_completion_request, "/v1/chat/completions": parse_chat_request}


@settings(max_examples=400, deadline=None)
@given(mutated_bodies(MODEL_ID, max_tokens=4))
@example(("/v1/completions", {"model": MODEL_ID, "prompt": "a\ud800b"}))
@example(("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}))
@example(("/v1/completions", {"prompt": "x", "stop": ["\ud83d"], "seed": -1}))
def test_parsers_answer_every_field_value_with_a_request_or_a_4xx(case: tuple[str, dict[str, Any]]) -> None:
    route, body = case
    try:
        body = decode_json_body(encode(body))
        PARSERS[route](body, request_id="r", model_ids=[MODEL_ID])
    except ApiError as error:
        assert 400 <= error.status < 500, error
        assert error.message and error.to_json()["error"]["message"] == error.message


@settings(max_examples=200, deadline=None)
@given(raw_bodies)
def test_any_body_is_a_json_object_or_a_400(raw: bytes) -> None:
    try:
        assert isinstance(decode_json_body(raw), dict)
    except ApiError as error:
        assert error.status == 400 and "JSON" in error.message


def assert_openai_error(status: int, body: Any) -> None:
    assert 400 <= status < 500, (status, body)
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, body
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    assert error["param"] is None or isinstance(error["param"], str)


async def post_and_check(session: aiohttp.ClientSession, url: str, raw: bytes) -> None:
    """One hostile POST: a 4xx with OpenAI's error JSON, or a full 200 answer (JSON, or SSE ending in [DONE])."""
    async with session.post(url, data=raw, headers={"Content-Type": "application/json"}) as response:
        text = await response.text()
        if response.status == 200:
            if response.content_type == "text/event-stream":
                assert text.rstrip().endswith("data: [DONE]") or '"error"' in text.rsplit("data: ", 1)[-1], text
            else:
                assert "choices" in await response.json()
            return
        assert_openai_error(response.status, await response.json(content_type=None))


@pytest.fixture
async def app_client() -> AsyncIterator[TestClient[web.Request, web.Application]]:
    app = create_app(ScriptedBackend(), api_keys=frozenset(), max_body_bytes=1 << 20, request_timeout_s=5.0)
    client = TestClient(TestServer(app, host="127.0.0.1"), timeout=aiohttp.ClientTimeout(total=30))
    await client.start_server()
    yield client
    await client.close()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(mutated_bodies(MODEL_ID).map(lambda case: (case[0], encode(case[1]))),
                 st.tuples(st.sampled_from(sorted(PARSERS)), raw_bodies)))
async def test_the_http_layer_answers_hostile_bodies_with_openai_errors(
    app_client: TestClient[web.Request, web.Application], case: tuple[str, bytes],
) -> None:
    route, raw = case
    await post_and_check(app_client.session, str(app_client.make_url(route)), raw)
    good = await app_client.post("/v1/completions", json={"model": MODEL_ID, "prompt": "ok", "max_tokens": 2})
    assert good.status == 200, "the next request is unharmed"
