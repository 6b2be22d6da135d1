"""Tool calling through a whole in-process cluster with the official `openai` client (tiny random model, whose ChatML
template takes the Hermes format): a required or named choice always returns parseable calls whose arguments follow
the tool's parameters, streamed calls reassemble into the same calls, and a history of calls and answers is taken."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.roles.cluster_fixtures import running_roles
from tests.roles.json_schemas import json_schemas
from tests.roles.test_conductor_flow import make_config

MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Lisbon?"}]
EOS = 2  # the tiny model's <|im_end|>


def tool(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": f"the {name} tool", "parameters": parameters}}


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[openai.AsyncOpenAI]:
    config = make_config(tmp_path)
    async with running_roles(config, ["s0", "p0", "d0", "c0"]):
        port = config.instance_named("c0").port
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none") as client:
            yield client


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])  # a cluster round trip per example: no shrinking
@given(json_schemas(), json_schemas(), st.sampled_from(["required", "first", "second"]), st.booleans(),
       st.integers(0, 3))
async def test_a_forced_choice_returns_calls_that_follow_the_tools(api: openai.AsyncOpenAI, first: dict[str, Any],
                                                                   second: dict[str, Any], choice: str,
                                                                   is_parallel: bool, seed: int) -> None:
    tools = [tool("first", first), tool("second", second)]
    parameters = {"first": first, "second": second}
    tool_choice: Any = "required" if choice == "required" else {"type": "function", "function": {"name": choice}}
    answer = await api.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=tools, tool_choice=tool_choice, parallel_tool_calls=is_parallel,
        max_tokens=400, temperature=1.0 if seed else 0.0, seed=seed,
        logit_bias={str(EOS): 10})  # between calls, where EOS may come, a random model would rarely pick it
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason == "tool_calls" and message.tool_calls, answer
    assert len(message.tool_calls) == 1 or is_parallel
    assert len({call.id for call in message.tool_calls}) == len(message.tool_calls)
    for call in message.tool_calls:
        assert call.type == "function" and (choice == "required" or call.function.name == choice)
        jsonschema.validate(json.loads(call.function.arguments), parameters[call.function.name])


async def test_streamed_calls_reassemble_into_the_same_calls(api: openai.AsyncOpenAI) -> None:
    parameters = {"type": "object", "required": ["city", "days"], "additionalProperties": False,
                  "properties": {"city": {"type": "string", "maxLength": 8},
                                 "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
    request: dict[str, Any] = {"model": "tiny", "messages": MESSAGES, "tools": [tool("weather", parameters)],
                               "tool_choice": "required", "max_tokens": 300, "temperature": 1.0, "seed": 11}
    whole = (await api.chat.completions.create(**request)).choices[0].message.tool_calls
    assert whole
    calls: dict[int, dict[str, str]] = {}
    finish = None
    async for chunk in await api.chat.completions.create(**request, stream=True):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            call["name"] += delta.function.name or "" if delta.function else ""
            call["arguments"] += delta.function.arguments or "" if delta.function else ""
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole]


async def test_a_history_of_calls_and_their_answers_is_taken(api: openai.AsyncOpenAI) -> None:
    history: list[Any] = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Lisbon"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"}]
    answer = await api.chat.completions.create(model="tiny", messages=history,
                                               tools=[tool("weather", {"type": "object"})], tool_choice="none",
                                               max_tokens=5, temperature=0.0)
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.tool_calls is None
