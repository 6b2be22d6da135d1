"""How model families write tool calls, and the grammar that makes a model write one (docs/api.md#tool-calling).

1. `tool_format_for(template_source)` picks the family's format by the markers its chat template writes: Mistral
   `[TOOL_CALLS]`, DeepSeek-V3 and Kimi K2 tool-call tokens, Llama 3.1 JSON (`<|python_tag|>`), else Hermes
   `<tool_call>` JSON (Qwen2.5, Qwen3, and ChatML models such as SmolLM2 whose template renders no tools).
2. `take_calls(rest)` reads the complete calls at the start of a tool-call section's unread text: the calls and the
   characters they took, or None while the next call is incomplete (or not a call: at the end of the output the
   parser then hands the text back as content).
3. `grammar(tools, is_parallel, token_ids)` is the Lark grammar (llguidance's dialect: each call's arguments a
   `%json` schema, a marker that is one token of the vocabulary written `<[id]>`) an answer follows when
   tool_choice is `required` or names a function.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mooncaked.model.json_bounds import bound_numbers

_DECODER = json.JSONDecoder()
# compact JSON in a grammar's %json (as model/grammar.py's JSON_OPTIONS): no endless whitespace
_COMPACT = {"x-guidance": {"whitespace_flexible": False}}
NEWLINE, SEMICOLON = '"\\n"', '"; "'  # Lark literals between parallel calls


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text
    id: str = ""  # the call's id when the format writes one (Kimi K2), else the conductor makes one


@dataclass(frozen=True)
class ToolDef:
    """What a grammar needs of a tool: its name and its arguments' JSON schema."""

    name: str
    parameters: Mapping[str, Any]


Taken = tuple[list[ParsedCall], int] | None


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    start: str  # the text that opens the tool-call section ("" : only the whole output, Llama 3.1 JSON)
    markers: tuple[str, ...]  # the format's markers (special tokens in its family: the text must keep them)
    take_calls: Callable[[str], Taken]
    write_grammar: Callable[[Sequence[ToolDef], bool, Callable[[str], str]], str]

    def grammar(self, tools: Sequence[ToolDef], is_parallel: bool, token_ids: Mapping[str, int]) -> str:
        def marker(text: str) -> str:
            token_id = token_ids.get(text)
            return f"<[{token_id}]>" if token_id is not None else json.dumps(text)
        return self.write_grammar(tools, is_parallel, marker)


def call_from_json(obj: object, arguments_key: str = "arguments") -> ParsedCall:
    """A call from {"name", "arguments"} (or "parameters"); ValueError when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("not a tool call object")
    arguments = obj.get(arguments_key, obj.get("parameters", obj.get("arguments", {})))
    return ParsedCall(obj["name"], _arguments_text(arguments))


def _arguments_text(arguments: object) -> str:
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        raise ValueError("arguments must be a JSON object")
    return json.dumps(arguments, ensure_ascii=False)


def _json_at(text: str) -> tuple[Any, int] | None:
    try:
        return _DECODER.raw_decode(text)
    except ValueError:
        return None


def _skip(text: str, fillers: Sequence[str]) -> int:
    """How many characters of whitespace and `fillers` open `text`."""
    position = 0
    while True:
        stripped = text[position:].lstrip()
        position = len(text) - len(stripped)
        filler = next((f for f in fillers if f and stripped.startswith(f)), None)
        if filler is None:
            return position
        position += len(filler)


def _object_schema(tool: ToolDef, arguments_key: str) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": tool.name}, arguments_key: dict(tool.parameters)},
            "required": ["name", arguments_key], "additionalProperties": False}


def _json(schema: Mapping[str, Any]) -> str:
    """A Lark %json of `schema`, written compact, its numbers bounded in length (model/json_bounds.py: a call
    always closes)."""
    return "%json " + json.dumps({**bound_numbers(schema), **_COMPACT}, ensure_ascii=False)


def _any_call(tools: Sequence[ToolDef], arguments_key: str = "arguments") -> str:
    return _json({"anyOf": [_object_schema(t, arguments_key) for t in tools]})


def _repeat(call: str, separator: str, is_parallel: bool) -> str:
    return f"start: {call} ({separator} {call})*" if is_parallel else f"start: {call}"


# ---- Hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one block per call ----------------------
def _take_hermes(rest: str) -> Taken:
    calls: list[ParsedCall] = []
    position = 0
    while True:
        begin = position + _skip(rest[position:], ())
        if not rest.startswith("<tool_call>", begin):
            return (calls, position) if calls else None
        end = rest.find("</tool_call>", begin)
        if end < 0:
            return (calls, position) if calls else None
        try:
            calls.append(call_from_json(json.loads(rest[begin + len("<tool_call>"):end])))
        except ValueError:
            return (calls, position) if calls else None
        position = end + len("</tool_call>")


def _hermes_grammar(tools: Sequence[ToolDef], is_parallel: bool, marker: Callable[[str], str]) -> str:
    call = f'{marker("<tool_call>")} "\\n" body "\\n" {marker("</tool_call>")}'
    return f'{_repeat("call", NEWLINE, is_parallel)}\ncall: {call}\nbody: {_any_call(tools)}'


# ---- Llama 3.1 JSON: the whole output is {"name": ..., "parameters": {...}}, calls separated by "; " ------------
def _take_llama(rest: str) -> Taken:
    calls: list[ParsedCall] = []
    position = 0
    while True:
        begin = position + _skip(rest[position:], ("<|python_tag|>", ";"))
        found = _json_at(rest[begin:]) if rest[begin:].startswith("{") else None
        if found is None:
            return (calls, position) if calls else None
        try:
            calls.append(call_from_json(found[0], "parameters"))
        except ValueError:
            return (calls, position) if calls else None
        position = begin + found[1]


def _llama_grammar(tools: Sequence[ToolDef], is_parallel: bool, marker: Callable[[str], str]) -> str:
    return f'{_repeat("call", SEMICOLON, is_parallel)}\ncall: {_any_call(tools, "parameters")}'


# ---- Mistral: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...], or [TOOL_CALLS]name[ARGS]{...} per call ------
_MISTRAL_NAMED = re.compile(r"([A-Za-z0-9_-]+)\[ARGS\]")


def _take_mistral(rest: str) -> Taken:
    calls: list[ParsedCall] = []
    position = 0
    while True:
        begin = position + _skip(rest[position:], ("[TOOL_CALLS]",))
        text = rest[begin:]
        named = _MISTRAL_NAMED.match(text)
        found = _json_at(text[named.end():] if named else text) if (named or text.startswith("[")) else None
        if found is None:
            return (calls, position) if calls else None
        try:
            if named:
                calls.append(ParsedCall(named.group(1), _arguments_text(found[0])))
            elif isinstance(found[0], list):
                calls.extend(call_from_json(item) for item in found[0])
            else:
                raise ValueError("not a list of calls")
        except ValueError:
            return (calls, position) if calls else None
        position = begin + (named.end() if named else 0) + found[1]


def _mistral_grammar(tools: Sequence[ToolDef], is_parallel: bool, marker: Callable[[str], str]) -> str:
    schema = {"type": "array", "items": {"anyOf": [_object_schema(t, "arguments") for t in tools]}, "minItems": 1}
    if not is_parallel:
        schema["maxItems"] = 1
    return f'start: {marker("[TOOL_CALLS]")} {_json(schema)}'


# ---- DeepSeek-V3: <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜> ---
DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_SEP, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
_DS_CALL = re.compile(re.escape(DS_CALL_BEGIN) + r"(?:function" + re.escape(DS_SEP) + r"(?P<name>[^\n]+)\n```json\n"
                      r"(?P<args>.*?)\n```|(?P<name31>[^<]+?)" + re.escape(DS_SEP) + r"(?P<args31>.*?))"
                      + re.escape(DS_CALL_END), re.DOTALL)


def _take_deepseek(rest: str) -> Taken:
    return _take_marked(rest, (DS_CALLS_BEGIN, DS_CALLS_END), _DS_CALL,
                        lambda m: ParsedCall((m.group("name") or m.group("name31")).strip(),
                                             _arguments_text(json.loads(m.group("args") or m.group("args31")))))


def _deepseek_grammar(tools: Sequence[ToolDef], is_parallel: bool, marker: Callable[[str], str]) -> str:
    calls = " | ".join(f'{marker(DS_CALL_BEGIN)} "function" {marker(DS_SEP)} {json.dumps(t.name)} "\\n```json\\n" '
                       f'{_json(t.parameters)} "\\n```" {marker(DS_CALL_END)}'
                       for t in tools)
    body = "call+" if is_parallel else "call"
    return f"start: {marker(DS_CALLS_BEGIN)} {body} {marker(DS_CALLS_END)}\ncall: {calls}"


# ---- Kimi K2: <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>ARGS<|tool_call_end|> ------------
KIMI_BEGIN, KIMI_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL, KIMI_ARGS, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_KIMI_CALL = re.compile(re.escape(KIMI_CALL) + r"\s*(?P<id>functions\.(?P<name>[^:<]+):\d+)\s*" + re.escape(KIMI_ARGS)
                        + r"\s*(?P<args>.*?)\s*" + re.escape(KIMI_CALL_END), re.DOTALL)


def _take_kimi(rest: str) -> Taken:
    return _take_marked(rest, (KIMI_BEGIN, KIMI_END), _KIMI_CALL,
                        lambda m: ParsedCall(m.group("name"), _arguments_text(json.loads(m.group("args"))),
                                             m.group("id")))


def _kimi_grammar(tools: Sequence[ToolDef], is_parallel: bool, marker: Callable[[str], str]) -> str:
    calls = " | ".join(f'{marker(KIMI_CALL)} "functions.{t.name}:" /[0-9]/ {marker(KIMI_ARGS)} '
                       f'{_json(t.parameters)} {marker(KIMI_CALL_END)}'
                       for t in tools)
    body = "call+" if is_parallel else "call"
    return f"start: {marker(KIMI_BEGIN)} {body} {marker(KIMI_END)}\ncall: {calls}"


def _take_marked(rest: str, fillers: tuple[str, ...], pattern: re.Pattern[str],
                 make: Callable[[re.Match[str]], ParsedCall]) -> Taken:
    calls: list[ParsedCall] = []
    position = 0
    while True:
        begin = position + _skip(rest[position:], fillers)
        match = pattern.match(rest, begin)
        if match is None:
            return (calls, position) if calls else None
        try:
            calls.append(make(match))
        except ValueError:
            return (calls, position) if calls else None
        position = match.end()


HERMES = ToolCallFormat("hermes", "<tool_call>", ("<tool_call>", "</tool_call>"), _take_hermes, _hermes_grammar)
LLAMA3_JSON = ToolCallFormat("llama3_json", "", ("<|python_tag|>",), _take_llama, _llama_grammar)
MISTRAL = ToolCallFormat("mistral", "[TOOL_CALLS]", ("[TOOL_CALLS]", "[ARGS]"), _take_mistral, _mistral_grammar)
DEEPSEEK_V3 = ToolCallFormat("deepseek_v3", DS_CALLS_BEGIN, (DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN, DS_SEP,
                                                           DS_CALL_END), _take_deepseek, _deepseek_grammar)
KIMI_K2 = ToolCallFormat("kimi_k2", KIMI_BEGIN, (KIMI_BEGIN, KIMI_END, KIMI_CALL, KIMI_ARGS, KIMI_CALL_END),
                         _take_kimi, _kimi_grammar)
FORMATS = (HERMES, LLAMA3_JSON, MISTRAL, DEEPSEEK_V3, KIMI_K2)


def tool_format_for(template_source: str) -> ToolCallFormat:
    for fmt, sign in ((DEEPSEEK_V3, DS_CALLS_BEGIN), (KIMI_K2, KIMI_BEGIN), (MISTRAL, "[TOOL_CALLS]"),
                      (LLAMA3_JSON, "<|python_tag|>")):
        if sign in template_source:
            return fmt
    return HERMES
