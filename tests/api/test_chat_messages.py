"""Chat messages: what each member becomes, and the member each refusal names."""

from __future__ import annotations

import pytest

from mooncaked.api.chat_messages import ChatMessage, read_messages
from mooncaked.api.errors import ApiError
from mooncaked.api.tools import ToolCall


def test_names_reach_the_template_and_null_members_are_nothing() -> None:
    messages = read_messages({"messages": [
        {"role": "user", "content": "hi", "name": "ann", "tool_calls": None, "refusal": None},
        {"role": "assistant", "content": None}]})
    assert messages == (ChatMessage("user", "hi", "ann"), ChatMessage("assistant", ""))
    assert messages[0].as_template_dict() == {"role": "user", "content": "hi", "name": "ann"}
    assert messages[1].as_template_dict() == {"role": "assistant", "content": ""}


@pytest.mark.parametrize(("message", "param"), [
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]}, "messages[0].tool_calls[0].function"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]},
     "messages[0].tool_calls[0].id"),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {}}}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"role": "user", "content": "hi", "tool_calls": []}, "messages[0].tool_calls"),
    ({"role": "user", "content": "42", "tool_call_id": "c1"}, "messages[0].tool_call_id"),
    ({"role": "assistant", "content": None, "function_call": {"name": "f"}}, "messages[0].function_call"),
    ({"role": "assistant", "content": "no", "refusal": "no"}, "messages[0].refusal"),
    ({"role": "user", "content": "hi", "colour": "red"}, "messages[0].colour"),
    ({"role": "user", "content": "hi", "name": 3}, "messages[0].name"),
    ({"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}, "messages[0].content[0]"),
])
def test_members_that_cannot_be_rendered_are_refused_by_name(message: dict[str, object], param: str) -> None:
    with pytest.raises(ApiError) as raised:
        read_messages({"messages": [message]})
    assert raised.value.status == 400 and raised.value.param == param


def test_a_tool_call_turn_and_its_answer_reach_the_template() -> None:
    messages = read_messages({"messages": [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "content": "2", "tool_call_id": "c1"}]})
    assert messages[0].tool_calls == (ToolCall("c1", "f", '{"a": 1}'),)
    assert messages[0].as_template_dict()["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]
    assert messages[1].as_template_dict() == {"role": "tool", "content": "2", "tool_call_id": "c1"}
