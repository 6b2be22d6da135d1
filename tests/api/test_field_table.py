"""docs/api.md's field table, walked: it matches the code's table (api/request_fields.py), every honoured, partly
honoured or accepted field is served with an example value, and every refused value is a 400 naming the field
(the real HTTP app in front of the scripted backend)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from mooncaked.api.app import create_app
from mooncaked.api.request_fields import ACCEPTED, CHAT, COMPLETIONS, FIELDS, HONOURED, PARTLY, REFUSED
from tests.api.scripted_backend import MODEL_ID, ScriptedBackend

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
ROUTE_PATHS = {COMPLETIONS: "/v1/completions", CHAT: "/v1/chat/completions"}

# a value each served field is served with (beside the base body), and one each refused or partly served field is
# refused with; a row of the table without its example here fails the walk
SERVED: dict[str, Any] = {
    "model": MODEL_ID, "prompt": [[1, 2, 3]], "prompt_logprobs": 2, "messages": [{"role": "user", "content": "hi", "name": "ann"}],
    "max_tokens": 3, "max_completion_tokens": 3, "temperature": 0.5, "top_p": 0.9, "seed": 7, "stop": ["x"],
    "stream": False, "stream_options": None, "logprobs": None, "top_logprobs": None, "n": 2, "best_of": 2,
    "echo": True, "frequency_penalty": 0.5, "presence_penalty": -0.5, "logit_bias": {"5": -100},
    "user": "u-1", "metadata": {"k": "v"}, "modalities": ["text"], "parallel_tool_calls": False,
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "prompt_cache_key": "k", "safety_identifier": "s", "service_tier": "auto",
    "store": False, "tool_choice": "none", "verbosity": "medium", "top_k": 5, "min_p": 0.1,
    "repetition_penalty": 1.1, "min_tokens": 1, "stop_token_ids": [5], "ignore_eos": True,
    "include_stop_str_in_output": True, "skip_special_tokens": False, "priority": -1, "cache_salt": "salt",
    "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}},
    "guided_json": {"type": "object"}, "guided_regex": "[a-z]+", "guided_choice": ["yes", "no"],
    "guided_grammar": 'start: "x"', "structured_outputs": {"choice": ["a", "b"]},
    "chat_template_kwargs": {"enable_thinking": False},
}
REFUSED_VALUES: dict[str, Any] = {
    "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
    "stream_options": {"include_obfuscation": True}, "suffix": "end",
    "audio": {"voice": "alloy", "format": "wav"}, "function_call": "auto", "functions": [{"name": "f"}],
    "modalities": ["text", "audio"], "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low",
    "service_tier": "flex", "store": True, "verbosity": "high",
    "web_search_options": {},
}
# values a partly served field is served with besides the one above (both kinds of its shape)
MORE_SERVED: dict[str, list[Any]] = {
    "stream_options": [{"include_usage": True, "include_obfuscation": False}],
    "logprobs": [2],  # chat: true
    "top_logprobs": [2],
    "response_format": [{"type": "text"}, {"type": "json_object"}],
    "tool_choice": ["auto", "required", {"type": "function", "function": {"name": "f"}}],
    "prompt": [["one", "two"], "one"],
}


def doc_rows() -> list[tuple[str, frozenset[str], str]]:
    text = API_DOC.read_text()
    section = text.split("### Request fields", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        match = re.match(r"^\| `([a-z_]+)` \| (both|completions|chat) \| (\w+) \|", line)
        if match:
            name, routes, use = match.groups()
            rows.append((name, frozenset({COMPLETIONS, CHAT}) if routes == "both" else frozenset({routes}), use))
    return rows


def cases(uses: set[str]) -> list[tuple[str, str]]:
    return [(name, route) for name, routes, use in doc_rows() if use in uses for route in sorted(routes)]


def base(route: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL_ID, "max_tokens": 3}
    if route == COMPLETIONS:
        body["prompt"] = "hello"
    else:
        body["messages"] = [{"role": "user", "content": "hello"}]
    return body


def shaped(name: str, route: str, value: Any) -> dict[str, Any]:
    """The base body with `name` set; fields that depend on another get it too."""
    body = {**base(route), name: value}
    if name == "stream_options":
        body["stream"] = True
    if name == "top_logprobs":
        body["logprobs"] = True
    if name in ("tool_choice", "parallel_tool_calls"):
        body["tools"] = SERVED["tools"]
    if name == "logprobs" and value is not None:
        body[name] = value if route == COMPLETIONS else bool(value)
    return body


@pytest.fixture
async def client() -> AsyncIterator[TestClient[web.Request, web.Application]]:
    app = create_app(ScriptedBackend(), max_body_bytes=1 << 20, request_timeout_s=5.0)
    test_client = TestClient(TestServer(app, host="127.0.0.1"))
    await test_client.start_server()
    yield test_client
    await test_client.close()


def test_the_doc_table_is_the_code_table() -> None:
    rows = doc_rows()
    assert len({name for name, _, _ in rows}) == len(rows), "a field is listed twice"
    assert {name: (routes, use) for name, routes, use in rows} == {
        name: (field.routes, field.use) for name, field in FIELDS.items()}
    assert all(use in (HONOURED, PARTLY, ACCEPTED, REFUSED) for _, _, use in rows)
    served = {name for name, _, use in rows if use != REFUSED}
    refused = {name for name, _, use in rows if use in (PARTLY, REFUSED)}
    assert served == set(SERVED) and refused == set(REFUSED_VALUES)


@pytest.mark.parametrize(("name", "route"), cases({HONOURED, PARTLY, ACCEPTED}))
async def test_a_served_field_is_served(client: TestClient[web.Request, web.Application], name: str,
                                        route: str) -> None:
    for value in [SERVED[name], *MORE_SERVED.get(name, [])]:
        response = await client.post(ROUTE_PATHS[route], json=shaped(name, route, value))
        assert response.status == 200, (name, value, await response.text())
        await response.read()


@pytest.mark.parametrize(("name", "route"), cases({PARTLY, REFUSED}))
async def test_a_refused_value_is_a_400_naming_the_field(client: TestClient[web.Request, web.Application],
                                                         name: str, route: str) -> None:
    response = await client.post(ROUTE_PATHS[route], json=shaped(name, route, REFUSED_VALUES[name]))
    error = (await response.json())["error"]
    assert response.status == 400, (name, error)
    assert error["param"] == name or error["param"].startswith((f"{name}.", f"{name}[")), error


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
async def test_a_field_the_route_does_not_know_is_a_400_naming_it(client: TestClient[web.Request, web.Application],
                                                                  route: str) -> None:
    other = "suffix" if route == CHAT else "tools"  # the other route's field
    for name in ("guided_decoding_backend", other):
        response = await client.post(ROUTE_PATHS[route], json={**base(route), name: {"type": "object"}})
        error = (await response.json())["error"]
        assert response.status == 400 and error["param"] == name, error
        assert "unrecognized request argument" in error["message"]
