"""Constrained decoding's engine side (model/grammar.py) with the test models' byte-level tokenizer: every kind of
constraint compiles to a grammar whose masks let a matching output through token by token and nothing else;
states rebuild from an output so far; what cannot compile says why."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mooncaked.model.frontend import load_frontend
from mooncaked.model.grammar import GrammarError, GrammarState, GrammarTokenizer, grammar_for
from mooncaked.model.tokenizer import byte_level_test_tokenizer

TOKENIZER = byte_level_test_tokenizer()
EOS = 2
VOCAB = 320  # the tiny test model's logits are wider than its tokenizer
GRAMMARS = GrammarTokenizer(TOKENIZER, VOCAB, [EOS])


def walk(grammar: str, text: str) -> GrammarState:
    """Feed `text` token by token, checking each is allowed; the state after it."""
    state = GrammarState(GRAMMARS, grammar)
    for token_id in TOKENIZER.encode(text, add_special_tokens=False):
        allowed = state.allowed()
        assert allowed.shape == (VOCAB,) and bool(allowed[token_id]), (text, token_id)
        assert torch.equal(state.logit_mask() == 0, allowed)
        state.advance(token_id)
    return state


@pytest.mark.parametrize(("kind", "value", "text"), [
    ("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
     '{"a":12}'),
    ("json_object", "", '{"x":[1,"y"]}'),
    ("regex", r"\d{3}-[a-z]+", "123-abc"),
    ("choice", json.dumps(["yes", "no"]), "no"),
    ("grammar", 'start: "(" NUMBER ")"\nNUMBER: /[0-9]+/', "(42)"),
    ("grammar", 'root ::= "x" [0-9]+', "x7"),  # GBNF, as llama.cpp and vLLM's xgrammar take it
])
def test_each_kind_lets_a_matching_output_through_and_ends_it(kind: str, value: str, text: str) -> None:
    grammar = grammar_for(kind, value)
    assert GRAMMARS.check(grammar) == ""
    state = walk(grammar, text)
    if kind in ("json_schema", "json_object", "choice"):
        assert state.is_done  # nothing may follow: the sequence ends without sampling EOS


def test_a_token_the_grammar_refuses_is_masked_and_raises() -> None:
    state = GrammarState(GRAMMARS, grammar_for("choice", json.dumps(["yes", "no"])))
    allowed = state.allowed()
    assert set(torch.nonzero(allowed).flatten().tolist()) == {TOKENIZER.encode(c, add_special_tokens=False)[0]
                                                              for c in ("y", "n")}
    with pytest.raises(GrammarError, match="does not follow"):
        state.advance(TOKENIZER.encode("x", add_special_tokens=False)[0])


def test_a_state_rebuilt_from_the_output_so_far_equals_the_one_that_produced_it() -> None:
    grammar = grammar_for("json_schema", json.dumps({"type": "array", "items": {"enum": ["ab", "cd"]}}))
    output = TOKENIZER.encode('["ab","c', add_special_tokens=False)
    walked = walk(grammar, '["ab","c')
    rebuilt = GrammarState(GRAMMARS, grammar, output)
    assert torch.equal(walked.allowed(), rebuilt.allowed())
    with pytest.raises(GrammarError):
        GrammarState(GRAMMARS, grammar, TOKENIZER.encode('["x', add_special_tokens=False))


@pytest.mark.parametrize(("kind", "value", "error"), [
    ("json_schema", json.dumps({"type": "intger"}), "intger"),
    ("regex", "[a-z", "unclosed"),
    ("grammar", "start: undefined_rule", "undefined"),
    ("grammar", 'root ::= "x', "end of input"),
    ("json_schema", "not json", "Expecting value"),
])
def test_what_cannot_compile_says_why(kind: str, value: str, error: str) -> None:
    with pytest.raises(GrammarError, match=error):
        grammar = grammar_for(kind, value)
        message = GRAMMARS.check(grammar)
        if message:
            raise GrammarError(message)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=8),
                min_size=1, max_size=4, unique=True))
def test_any_choice_is_taken_verbatim(choices: list[str]) -> None:
    """Quotes, backslashes, control characters and any code point stay literal in the choice grammar."""
    grammar = grammar_for("choice", json.dumps(choices))
    assert GRAMMARS.check(grammar) == ""
    for choice in choices:
        state = walk(grammar, choice)
        assert state.is_done or any(other != choice and other.startswith(choice) for other in choices)


SMOLLM2 = load_frontend("embedded:smollm2")
SMOLLM2_GRAMMARS = GrammarTokenizer(SMOLLM2.tokenizer, SMOLLM2.args.vocab_size, list(SMOLLM2.eos_token_ids))


@settings(max_examples=30, deadline=None)
@given(st.characters(codec="utf-8", exclude_categories=["Cs"], min_codepoint=0x80))
@example("\U0008D84D")  # bench agents' generated enum that failed mid-answer before the check
@example("\U00040000")
@example("\U0001F600")
def test_a_grammar_forcing_a_character_the_tokenizer_cannot_produce_is_refused_and_one_it_serves_is_followed(
        char: str) -> None:
    """SmolLM2's byte-level vocabulary has no token for the UTF-8 lead bytes of U+40000..U+BFFFF: a schema that
    forces such a character (an enum) is refused up front, naming it, instead of failing mid-answer; any other
    forced character is followed to the end, token by token, on the masks."""
    schema = {"type": "object", "properties": {"a": {"enum": [f"x{char}"]}}, "required": ["a"],
              "additionalProperties": False}
    grammar = grammar_for("json_schema", json.dumps(schema))
    error = SMOLLM2_GRAMMARS.check(grammar)
    if 0x40000 <= ord(char) <= 0xBFFFF:
        assert f"U+{ord(char):04X}" in error and "cannot produce" in error
        return
    assert error == ""
    state = GrammarState(SMOLLM2_GRAMMARS, grammar)
    for _ in range(64):
        if state.is_done:
            break
        state.advance(int(state.allowed().nonzero()[0]))  # the lowest allowed token: any must be followable
    assert state.is_done
