"""Each family's tool-call format (model/tool_formats.py, model/tool_parser.py): calls written as the family writes
them, streamed in any pieces after any content, read back as the same calls; the grammar of a forced choice lets
exactly such calls through; a template picks its family's format."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncaked.model.grammar import GrammarState, GrammarTokenizer, grammar_for
from mooncaked.model.tokenizer import byte_level_test_tokenizer
from mooncaked.model.tool_formats import (DEEPSEEK_V3, DS_CALL_BEGIN, DS_CALL_END, DS_CALLS_BEGIN, DS_CALLS_END, DS_SEP,
                                          FORMATS, HERMES, KIMI_ARGS, KIMI_BEGIN, KIMI_CALL, KIMI_CALL_END, KIMI_END,
                                          KIMI_K2, LLAMA3_JSON, MISTRAL, ToolCallFormat, ToolDef, tool_format_for)
from mooncaked.model.tool_parser import ToolCallParser

Call = tuple[str, dict[str, Any]]


def compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def write(fmt: ToolCallFormat, calls: list[Call]) -> str:
    """The calls as the family's model writes them."""
    if fmt is HERMES:
        return "\n".join(f"<tool_call>\n{compact({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)
    if fmt is LLAMA3_JSON:
        return "; ".join(compact({"name": n, "parameters": a}) for n, a in calls)
    if fmt is MISTRAL:
        return "[TOOL_CALLS]" + compact([{"name": n, "arguments": a} for n, a in calls])
    if fmt is DEEPSEEK_V3:
        return DS_CALLS_BEGIN + "".join(f"{DS_CALL_BEGIN}function{DS_SEP}{n}\n```json\n{compact(a)}\n```{DS_CALL_END}"
                                        for n, a in calls) + DS_CALLS_END
    return KIMI_BEGIN + "".join(f"{KIMI_CALL}functions.{n}:{i}{KIMI_ARGS}{compact(a)}{KIMI_CALL_END}"
                                for i, (n, a) in enumerate(calls)) + KIMI_END


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=6)
calls_of = st.lists(st.tuples(st.from_regex(r"[a-z_][a-z0-9_]{0,11}", fullmatch=True),
                              st.dictionaries(st.text(max_size=6), json_values, max_size=3)), min_size=1, max_size=3)


def read(fmt: ToolCallFormat, text: str, cuts: list[int]) -> tuple[str, list[Call]]:
    parser = ToolCallParser(fmt)
    content, calls = "", []
    for begin, end in zip([0, *cuts], [*cuts, len(text)]):
        more, done = parser.feed(text[begin:end])
        content, calls = content + more, calls + done
    more, done = parser.finish()
    return content + more, [(c.name, json.loads(c.arguments)) for c in calls + done]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(FORMATS), calls_of, st.text(max_size=12), st.data())
def test_calls_streamed_in_any_pieces_read_back_as_written(fmt: ToolCallFormat, calls: list[Call], prefix: str,
                                                           data: st.DataObject) -> None:
    if fmt is LLAMA3_JSON:
        prefix = ""  # its calls are the whole answer
    elif fmt.start in prefix or "<" in prefix or "[" in prefix:
        prefix = prefix.replace("<", "").replace("[", "")
    text = prefix + write(fmt, calls)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    assert read(fmt, text, cuts) == (prefix, calls)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_text_that_is_no_call_is_content(fmt: ToolCallFormat) -> None:
    assert read(fmt, "just words, no calls", [3, 9]) == ("just words, no calls", [])
    written = write(fmt, [("f", {"a": 1})])
    unfinished = written[: written.index('"a"') + 4]  # the output ended inside the call's arguments
    text = "ok " + unfinished if fmt.start else unfinished
    assert read(fmt, text, [5]) == (text, [])


PARAMETERS = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 50}},
              "required": ["a"], "additionalProperties": False}


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("is_parallel", [True, False])
def test_a_forced_choice_grammar_lets_valid_calls_through(fmt: ToolCallFormat, is_parallel: bool) -> None:
    tokenizer = byte_level_test_tokenizer()
    grammars = GrammarTokenizer(tokenizer, 320, [2])
    tools = [ToolDef("f", PARAMETERS), ToolDef("g", {"type": "object", "properties": {}})]
    grammar = grammar_for("grammar", fmt.grammar(tools, is_parallel, {}))
    assert grammars.check(grammar) == ""
    calls: list[Call] = [("f", {"a": 7}), ("g", {})] if is_parallel else [("f", {"a": 7})]
    state = GrammarState(grammars, grammar)
    for token_id in tokenizer.encode(write(fmt, calls), add_special_tokens=False):
        assert state.allowed()[token_id], (fmt.name, tokenizer.decode([token_id]))
        state.advance(token_id)
    wrong = write(fmt, [("f", {"a": 70})])  # beyond the tool's maximum
    state = GrammarState(grammars, grammar)
    assert not all(_follow(state, t) for t in tokenizer.encode(wrong, add_special_tokens=False))


def _follow(state: GrammarState, token_id: int) -> bool:
    if not state.allowed()[token_id]:
        return False
    state.advance(token_id)
    return True


def test_a_marker_that_is_one_token_is_named_by_id() -> None:
    grammar = HERMES.grammar([ToolDef("f", {})], False, {"<tool_call>": 151657})
    assert "<[151657]>" in grammar and '"</tool_call>"' in grammar


@pytest.mark.parametrize(("template", "fmt"), [
    ("{{ '<tool_call>' }}", HERMES), ("{% if tools %}<|python_tag|>{% endif %}", LLAMA3_JSON),
    ("[AVAILABLE_TOOLS][TOOL_CALLS]", MISTRAL), (DS_CALLS_BEGIN, DEEPSEEK_V3), (KIMI_BEGIN, KIMI_K2),
    ("<|im_start|>{{ content }}", HERMES),
])
def test_the_template_picks_the_format(template: str, fmt: ToolCallFormat) -> None:
    assert tool_format_for(template) is fmt
