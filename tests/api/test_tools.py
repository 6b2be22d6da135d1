"""Tools as requests spell them (api/tools.py): each tool and choice read, each bad member a 400 naming it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mooncaked.api.errors import ApiError
from mooncaked.api.requests import parse_chat_request
from mooncaked.api.tools import ToolSpec, ToolUse, read_tools

CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER = {"type": "function",
           "function": {"name": "get_weather", "description": "the weather", "parameters": CITY, "strict": True}}
BARE = {"type": "function", "function": {"name": "now"}}


def test_tools_and_the_default_choice() -> None:
    use = read_tools({"tools": [WEATHER, BARE]})
    assert use.tools == (ToolSpec("get_weather", "the weather", json.dumps(WEATHER["function"]["parameters"]), True),
                         ToolSpec("now", "", '{"type": "object", "properties": {}}'))
    assert use.choice == "auto" and use.is_enabled and not use.is_forced and use.is_parallel
    assert read_tools({}) == ToolUse() and not ToolUse().is_enabled
    assert not read_tools({"tools": [WEATHER], "tool_choice": "none"}).is_enabled
    named = read_tools({"tools": [WEATHER, BARE], "tool_choice": {"type": "function", "function": {"name": "now"}},
                        "parallel_tool_calls": False})
    assert named.is_forced and [t.name for t in named.forced_tools] == ["now"] and not named.is_parallel
    assert [t.name for t in read_tools({"tools": [WEATHER, BARE], "tool_choice": "required"}).forced_tools] == \
        ["get_weather", "now"]
    assert use.tools[0].as_template_dict()["function"]["parameters"] == WEATHER["function"]["parameters"]


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": {"a": 1}}, "tools"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "colour": 1}}]}, "tools[0].function.colour"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools[0].function.strict"),
    ({"tools": [BARE, BARE]}, "tools"),
    ({"tools": [BARE], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [BARE], "tool_choice": {"type": "function", "function": {"name": "other"}}},
     "tool_choice.function.name"),
    ({"tools": [BARE], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
])
def test_a_bad_member_is_a_400_naming_it(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as raised:
        read_tools(body)
    assert raised.value.status == 400 and raised.value.param == param


def test_tools_that_may_be_called_and_an_output_constraint_cannot_both_shape_one_answer() -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [BARE], "response_format": {"type": "json_object"}}
    with pytest.raises(ApiError) as raised:
        parse_chat_request(body, request_id="r", model_ids=["m"])
    assert raised.value.param == "response_format"
    assert parse_chat_request({**body, "tool_choice": "none"}, request_id="r", model_ids=["m"]).constraint is not None
