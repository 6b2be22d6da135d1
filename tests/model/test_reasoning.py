"""A thinking model's output split into reasoning and answer (model/reasoning.py), in any streamed pieces; where a
prompt leaves the block; the grammar that lets the reasoning run free before a constrained answer."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncaked.model.grammar import GrammarState, GrammarTokenizer, after_prefix, grammar_for
from mooncaked.model.reasoning import (CLOSED, INSIDE, OPTIONAL, THINK, ReasoningParser, reasoning_format_for,
                                       reasoning_lark, reasoning_mode)
from mooncaked.model.tokenizer import byte_level_test_tokenizer

texts = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=20).filter(
    lambda t: "<" not in t and t == t.strip())


def split(mode: str, text: str, cuts: list[int]) -> tuple[str, str]:
    parser = ReasoningParser(THINK, mode)
    reasoning = answer = ""
    for begin, end in zip([0, *cuts], [*cuts, len(text)]):
        more = parser.feed(text[begin:end])
        reasoning, answer = reasoning + more[0], answer + more[1]
    more = parser.finish()
    return reasoning + more[0], answer + more[1]


@settings(max_examples=100, deadline=None)
@given(texts, texts, st.sampled_from([INSIDE, OPTIONAL]), st.data())
def test_reasoning_and_answer_come_apart_in_any_pieces(thought: str, answer: str, mode: str,
                                                       data: st.DataObject) -> None:
    text = ("" if mode == INSIDE else "<think>") + thought + "</think>\n\n" + answer
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    assert split(mode, text, cuts) == (thought, answer)


def test_an_answer_without_a_block_and_a_block_never_closed() -> None:
    assert split(OPTIONAL, "just an answer", [2, 5]) == ("", "just an answer")
    assert split(CLOSED, "<think>x</think>y", [3]) == ("", "<think>x</think>y")
    assert split(INSIDE, "thinking and out of tokens </th", [7]) == ("thinking and out of tokens </th", "")


@pytest.mark.parametrize(("tail", "mode"), [
    ("<|im_start|>assistant\n", OPTIONAL),
    ("<｜Assistant｜><think>\n", INSIDE),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", CLOSED),
    ("earlier <think>a</think> answer<|im_start|>assistant\n", OPTIONAL),
])
def test_the_prompt_tail_says_where_the_output_starts(tail: str, mode: str) -> None:
    assert reasoning_mode(tail, THINK) == mode


def test_a_template_with_a_think_block_makes_a_thinking_model() -> None:
    assert reasoning_format_for("{% if enable_thinking is false %}<think>\n\n</think>{% endif %}") is THINK
    assert reasoning_format_for("<|im_start|>{{ content }}") is None


@pytest.mark.parametrize(("mode", "text", "is_valid"), [
    (OPTIONAL, '<think>any {"text"} at all</think>\n\n{"a":1}', True),
    (OPTIONAL, '{"a":1}', True),
    (OPTIONAL, '<think>x</think>not json', False),
    (INSIDE, 'free </thin text</think>{"a":2}', True),
    (CLOSED, '{"a":3}', True),
])
def test_a_constraint_applies_to_the_answer_only(mode: str, text: str, is_valid: bool) -> None:
    tokenizer = byte_level_test_tokenizer()
    grammars = GrammarTokenizer(tokenizer, 320, [2])
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    grammar = after_prefix(reasoning_lark(THINK, mode, {}), grammar_for("json_schema", json.dumps(schema)))
    assert grammars.check(grammar) == ""
    state = GrammarState(grammars, grammar)
    followed = True
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        if not state.allowed()[token_id]:
            followed = False
            break
        state.advance(token_id)
    assert followed == is_valid and (not is_valid or state.is_done)
