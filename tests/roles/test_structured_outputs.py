"""Structured outputs through a whole in-process cluster (store, prefill, decode, conductor; tiny random model): the
prefill instance samples the first token under the grammar, the decode instance rebuilds it from the tokens so far,
and every answer to a generated schema parses and validates; a stream migrated mid-way keeps to the grammar."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from mooncaked.bench.agent_schemas import json_schemas
from mooncaked.config import Config
from mooncaked.model.loader import load_model
from mooncaked.roles.worker.decode.role import DecodeRole
from tests.roles.cluster_fixtures import running_roles
from tests.roles.test_conductor_flow import completion, make_config, url
from tests.roles.test_failover import failover_config, metric, stream_interrupted

MAX_TOKENS = 400


class Live:
    def __init__(self, config: Config, http: aiohttp.ClientSession) -> None:
        self.config, self.http = config, http

    async def post(self, route: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        async with self.http.post(url(self.config, route), json=body) as response:
            return response.status, await response.json()


@pytest.fixture
async def live(tmp_path: Path) -> AsyncIterator[Live]:
    config = make_config(tmp_path)
    async with running_roles(config, ["s0", "p0", "d0", "c0"]), aiohttp.ClientSession() as http:
        yield Live(config, http)


def request(route: str, constraint: dict[str, Any], *, seed: int) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": MAX_TOKENS, "temperature": 1.0 if seed else 0.0, "seed": seed,
                            **constraint}
    if route == "/v1/completions":
        return {**body, "prompt": "Answer in JSON:"}
    return {**body, "messages": [{"role": "user", "content": "Answer in JSON."}]}


def answer_text(route: str, data: dict[str, Any]) -> str:
    choice = data["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    return str(choice["text"] if route == "/v1/completions" else choice["message"]["content"])


@settings(max_examples=24, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])  # a cluster round trip per example: no shrinking
@given(json_schemas(), st.sampled_from(["/v1/completions", "/v1/chat/completions"]), st.integers(0, 3))
async def test_answers_to_generated_schemas_parse_and_validate(live: Live, schema: dict[str, Any], route: str,
                                                               seed: int) -> None:
    format_ = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    status, data = await live.post(route, request(route, {"response_format": format_}, seed=seed))
    assert status == 200, data
    jsonschema.validate(json.loads(answer_text(route, data)), schema)


async def test_json_object_regex_choice_and_grammar(live: Live) -> None:
    tokenizer = load_model("random:tiny").tokenizer
    # any JSON object has strings of any length: a random model closes them and the object soon only when pushed
    closing = {str(tokenizer.encode(c, add_special_tokens=False)[0]): 8.0 for c in '"}'}
    cases: list[tuple[dict[str, Any], Any]] = [
        ({"response_format": {"type": "json_object"}, "logit_bias": closing},
         lambda text: isinstance(json.loads(text), dict)),
        ({"guided_regex": r"[A-Z]{2}-\d{3}"}, lambda text: re.fullmatch(r"[A-Z]{2}-\d{3}", text)),
        ({"guided_choice": ["red", "green", "blue"]}, lambda text: text in ("red", "green", "blue")),
        ({"guided_grammar": 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,3}/'},
         lambda text: re.fullmatch(r"\(\d{1,3}(,\d{1,3})*\)", text)),
        ({"structured_outputs": {"regex": "(yes|no)!"}}, lambda text: text in ("yes!", "no!")),
    ]
    for constraint, check in cases:
        for seed in (0, 1, 2):
            status, data = await live.post("/v1/completions", request("/v1/completions", constraint, seed=seed))
            assert status == 200, data
            text = answer_text("/v1/completions", data)
            assert check(text), (constraint, text)


async def test_a_streamed_answer_reassembles_into_a_valid_one(live: Live) -> None:
    schema = {"type": "object", "required": ["a", "b"], "additionalProperties": False,
              "properties": {"a": {"type": "array", "maxItems": 3, "items": {"enum": ["x", "y"]}},
                             "b": {"type": "integer", "minimum": 0, "maximum": 99}}}
    body = {**request("/v1/chat/completions", {"guided_json": schema}, seed=1), "stream": True}
    texts = []
    async with live.http.post(url(live.config, "/v1/chat/completions"), json=body) as response:
        assert response.status == 200
        async for raw in response.content:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                delta = json.loads(line.removeprefix("data: "))["choices"][0]["delta"]
                texts.append(delta.get("content") or "")
    jsonschema.validate(json.loads("".join(texts)), schema)


@pytest.mark.parametrize(("field", "value", "param"), [
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "intger"}}},
     "response_format.json_schema.schema"),
    ("guided_regex", "[a-z", "guided_regex"),
    ("guided_grammar", "start: nowhere", "guided_grammar"),
])
async def test_a_constraint_that_cannot_compile_is_a_400_naming_its_field(live: Live, field: str, value: Any,
                                                                           param: str) -> None:
    status, data = await live.post("/v1/completions", request("/v1/completions", {field: value}, seed=0))
    assert status == 400 and data["error"]["param"] == param, data


async def test_a_stream_migrated_mid_way_resumes_under_the_same_grammar(tmp_path: Path) -> None:
    config = failover_config(tmp_path, [("s0", "store"), ("p0", "prefill"), ("d0", "decode"), ("d1", "decode"),
                                        ("c0", "conductor")])
    schema = {"type": "object", "required": ["items"], "additionalProperties": False,
              "properties": {"items": {"type": "array", "minItems": 3, "maxItems": 3,
                                       "items": {"type": "string", "maxLength": 6}}}}
    body = {"prompt": "list:", "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "l", "schema": schema}}}
    async with running_roles(config, ["s0", "p0", "d0", "d1", "c0"]) as roles, aiohttp.ClientSession() as http:
        decodes = [roles["d0"], roles["d1"]]
        assert all(isinstance(role, DecodeRole) for role in decodes)
        plain = await completion(http, config, {**body, "stream": False})

        async def stop_the_streaming_instance() -> None:
            # the instance with the lower predicted TBT has it: either of the two, by their fitted step models
            (streaming,) = [role for role in decodes if isinstance(role, DecodeRole) and role.loop.running]
            await streaming.loop.stop()

        streamed, _ = await asyncio.wait_for(stream_interrupted(http, url(config, "/v1/completions"), body,
                                                                stop_the_streaming_instance), 60)
        assert streamed == plain["choices"][0]["text"]
        jsonschema.validate(json.loads(streamed), schema)
        assert (await metric(http, config, "mooncaked_migrations_total{")).startswith(
            'mooncaked_migrations_total{cause="decode_lost"} 1.0')
