"""Tool calling on chat requests: `tools`, `tool_choice`, `parallel_tool_calls`, and the tool calls of earlier
assistant turns (docs/api.md#tool-calling).

1. `read_tools(body)` checks every tool (a function: name, description, JSON-schema parameters, strict) and the
   choice among them, and returns a frozen `ToolUse`; the first bad member raises a 400 naming it.
2. `read_tool_calls(value, param)` reads an assistant message's `tool_calls` (id, type function, name, arguments as
   a JSON string) for the chat template.
What the conductor does with them (render, constrain, parse) is in roles/conductor/ and model/tool_formats.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mooncaked.api.errors import invalid_field
from mooncaked.api.fields import check_text, json_type, read_bool

MAX_TOOLS = 128  # OpenAI's limit
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
TOOL_CHOICES = ("none", "auto", "required")
FUNCTION_MEMBERS = frozenset({"name", "description", "parameters", "strict"})


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: str  # the JSON schema of its arguments, as JSON text ({"type": "object"} when none was given)
    strict: bool | None = None

    def as_template_dict(self) -> dict[str, Any]:
        """The tool as chat templates read it (OpenAI's shape)."""
        function: dict[str, Any] = {"name": self.name, "description": self.description,
                                    "parameters": json.loads(self.parameters)}
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolUse:
    tools: tuple[ToolSpec, ...] = ()
    choice: str = "none"  # none, auto, required, or "function" (then `function` names it)
    function: str = ""
    is_parallel: bool = True  # parallel_tool_calls: more than one call per answer

    @property
    def is_enabled(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    @property
    def is_forced(self) -> bool:
        """The answer must be a tool call (`required` or a named function): constrained decoding makes it one."""
        return self.choice in ("required", "function")

    @property
    def forced_tools(self) -> tuple[ToolSpec, ...]:
        return tuple(t for t in self.tools if self.choice != "function" or t.name == self.function)


@dataclass(frozen=True)
class ToolCall:
    """A tool call of an earlier assistant turn."""

    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def as_template_dict(self) -> dict[str, Any]:
        """Templates read `arguments` as an object (they write it with tojson), as vLLM hands it to them."""
        try:
            arguments: Any = json.loads(self.arguments)
        except ValueError:
            arguments = self.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": arguments}}


def read_tools(body: Mapping[str, Any]) -> ToolUse:
    value = body.get("tools")
    if value is None:
        tools: tuple[ToolSpec, ...] = ()
    elif not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise invalid_field("tools", f"expected a list of at most {MAX_TOOLS} tools")
    else:
        tools = tuple(_read_tool(tool, f"tools[{i}]") for i, tool in enumerate(value))
    names = [tool.name for tool in tools]
    if len(set(names)) != len(names):
        raise invalid_field("tools", "two tools have the same name")
    choice, function = _read_choice(body.get("tool_choice"), set(names))
    return ToolUse(tools, choice, function, read_bool(body, "parallel_tool_calls", True))


def _read_tool(tool: object, param: str) -> ToolSpec:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise invalid_field(f"{param}.type", "only tools of type 'function' are supported")
    for key in tool:
        if key not in ("type", "function"):
            raise invalid_field(f"{param}.{key}", "unrecognized; a tool has type and function")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise invalid_field(f"{param}.function", f"expected an object, got {json_type(function)}")
    for key in function:
        if key not in FUNCTION_MEMBERS:
            raise invalid_field(f"{param}.function.{key}", f"unrecognized; a function has {sorted(FUNCTION_MEMBERS)}")
    name = function.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.match(name):
        raise invalid_field(f"{param}.function.name", "required: 1 to 64 letters, digits, underscores or dashes")
    description = function.get("description", "")
    if not isinstance(description, str):
        raise invalid_field(f"{param}.function.description", f"expected a string, got {json_type(description)}")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise invalid_field(f"{param}.function.parameters", f"expected a JSON schema object, got "
                            f"{json_type(parameters)}")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid_field(f"{param}.function.strict", f"expected true or false, got {json_type(strict)}")
    try:
        text = json.dumps(parameters, ensure_ascii=False, allow_nan=False)
    except ValueError:
        raise invalid_field(f"{param}.function.parameters", "NaN and infinities are not JSON") from None
    return ToolSpec(name, check_text(description, f"{param}.function.description"),
                    check_text(text, f"{param}.function.parameters"), strict)


def _read_choice(value: object, names: set[str]) -> tuple[str, str]:
    if value is None:
        return ("auto" if names else "none"), ""
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise invalid_field("tool_choice", f"expected one of {list(TOOL_CHOICES)} or a named function")
        if value != "none" and not names:
            raise invalid_field("tool_choice", f"{value!r} needs tools")
        return value, ""
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(value.get("function"), dict):
        raise invalid_field("tool_choice", 'expected {"type": "function", "function": {"name": ...}}')
    name = value["function"].get("name")
    if name not in names:
        raise invalid_field("tool_choice.function.name", f"names no tool of this request: {name!r}")
    return "function", str(name)


def read_tool_calls(value: object, param: str) -> tuple[ToolCall, ...]:
    if not isinstance(value, list):
        raise invalid_field(param, f"expected a list of tool calls, got {json_type(value)}")
    calls = []
    for i, call in enumerate(value):
        where = f"{param}[{i}]"
        if not isinstance(call, dict) or call.get("type", "function") != "function":
            raise invalid_field(where, "expected a tool call of type 'function'")
        function = call.get("function")
        if not isinstance(function, dict):
            raise invalid_field(f"{where}.function", f"expected an object, got {json_type(function)}")
        call_id, name, arguments = call.get("id"), function.get("name"), function.get("arguments", "{}")
        if not isinstance(call_id, str) or not call_id:
            raise invalid_field(f"{where}.id", "required: the call's id (the tool message answers it)")
        if not isinstance(name, str) or not name:
            raise invalid_field(f"{where}.function.name", "required: the function's name")
        if not isinstance(arguments, str):
            raise invalid_field(f"{where}.function.arguments", "expected the arguments as a JSON string")
        calls.append(ToolCall(check_text(call_id, f"{where}.id"), check_text(name, f"{where}.function.name"),
                              check_text(arguments, f"{where}.function.arguments")))
    return tuple(calls)
