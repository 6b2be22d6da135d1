"""The `messages` of a chat request: roles, text content, names, tool calls and the answers to them.

1. `read_messages(body)` checks every message and returns them as frozen `ChatMessage`s; the first bad member
   raises a 400 naming it (`messages[2].content[0].type`).
2. Content is a string or a list of text parts (joined with newlines); other part types (images, audio, files)
   and members this server cannot render are refused, never dropped. An assistant message may carry
   `tool_calls` (tools.py), a tool message the `tool_call_id` it answers; the chat template renders both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mooncaked.api.errors import invalid_field
from mooncaked.api.fields import check_text, json_type
from mooncaked.api.tools import ToolCall, read_tool_calls

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})
UNRENDERED_FIELDS = {  # members OpenAI defines that no message here may carry (null is fine)
    "function_call": "the deprecated function calling is not supported: send tool_calls",
    "audio": "audio is not supported",
    "refusal": "a refusal cannot be rendered into the prompt; put it in content",
}


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    name: str = ""  # a participant's name ("" for none); the chat template may render it
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant turn's calls
    tool_call_id: str = ""  # a tool message: the call it answers

    def as_template_dict(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name:
            entry["name"] = self.name
        if self.tool_calls:
            entry["tool_calls"] = [call.as_template_dict() for call in self.tool_calls]
        if self.tool_call_id:
            entry["tool_call_id"] = self.tool_call_id
        return entry


def read_messages(body: Mapping[str, Any]) -> tuple[ChatMessage, ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid_field("messages", "expected a non-empty list of {role, content} objects")
    return tuple(_read_message(message, f"messages[{i}]") for i, message in enumerate(messages))


def _read_message(message: object, param: str) -> ChatMessage:
    if not isinstance(message, dict):
        raise invalid_field(param, f"expected an object, got {json_type(message)}")
    for key, value in message.items():
        if key in MESSAGE_FIELDS or value is None:
            continue
        why = UNRENDERED_FIELDS.get(key, f"unrecognized message member; a message has {sorted(MESSAGE_FIELDS)}")
        raise invalid_field(f"{param}.{key}", why)
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise invalid_field(f"{param}.role", f"expected one of {sorted(CHAT_ROLES)}, got {role!r}")
    name = message.get("name")
    if name is not None and not isinstance(name, str):
        raise invalid_field(f"{param}.name", f"expected a string, got {json_type(name)}")
    calls = message.get("tool_calls")
    if calls is not None and role != "assistant":
        raise invalid_field(f"{param}.tool_calls", "only an assistant message carries tool calls")
    call_id = message.get("tool_call_id")
    if call_id is not None and (role != "tool" or not isinstance(call_id, str)):
        raise invalid_field(f"{param}.tool_call_id", "a tool message's tool_call_id is the string id it answers")
    content = message.get("content")
    text = "" if content is None and role == "assistant" else _read_content(content, f"{param}.content")
    return ChatMessage(role=role, content=text, name=check_text(name or "", f"{param}.name"),
                       tool_calls=() if calls is None else read_tool_calls(calls, f"{param}.tool_calls"),
                       tool_call_id=check_text(call_id or "", f"{param}.tool_call_id"))


def _read_content(content: object, param: str) -> str:
    if isinstance(content, str):
        return check_text(content, param)
    if not isinstance(content, list):
        raise invalid_field(param, f"expected a string or a list of text parts, got {json_type(content)}")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise invalid_field(f"{param}[{j}]", "only parts of type 'text' are supported")
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid_field(f"{param}[{j}].text", f"expected a string, got {json_type(text)}")
        texts.append(check_text(text, f"{param}[{j}].text"))
    return "\n".join(texts)
