"""Numbers of bounded length in constrained JSON (model/json_bounds.py): a sampler that writes a digit whenever the
grammar lets it (what a model that ran away did under tool_choice `required`) still closes every document and
every forced tool call within a small token budget, and what it writes validates against the client's own
schema; numbers inside the bounds still pass."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from mooncaked.model.grammar import GrammarState, GrammarTokenizer, grammar_for
from mooncaked.model.json_bounds import MAX_FRACTION_DIGITS, MAX_INTEGER_DIGITS, bound_numbers
from mooncaked.model.tokenizer import byte_level_test_tokenizer
from mooncaked.model.tool_formats import FORMATS, ToolCallFormat, ToolDef

TOKENIZER = byte_level_test_tokenizer()
GRAMMARS = GrammarTokenizer(TOKENIZER, 320, [2])
DIGITS = [TOKENIZER.encode(str(d), add_special_tokens=False)[0] for d in range(1, 10)]
CLOSERS = [TOKENIZER.encode(c, add_special_tokens=False)[0] for c in '"}]']
MAX_NUMBER_CHARS = 1 + MAX_INTEGER_DIGITS + 1 + MAX_FRACTION_DIGITS  # sign, digits, point, digits
BUDGET = 400  # tokens (bytes here) the runaway sampler may take for a whole document

SCHEMAS: list[dict[str, Any]] = [
    {"type": "number"},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": 0, "maximum": 100}}, "required": ["x"]},
    {"type": "object", "properties": {"n": {"type": "integer"}, "v": {"type": ["number", "null"]}},
     "required": ["n", "v"], "additionalProperties": False},
    {"type": "array", "items": {"type": "number", "exclusiveMinimum": 0}, "minItems": 2, "maxItems": 3},
    {"type": "object", "properties": {"free": {}, "deep": {"type": "object"}}, "required": ["free", "deep"]},
]


def run_away(grammar: str) -> str:
    """Outside a string, write a digit whenever allowed, else close what is open, else the lowest allowed token
    (inside a string, close it first: a string's length is not what is bounded); the text once the grammar is done
    (fails past BUDGET tokens)."""
    state = GrammarState(GRAMMARS, grammar)
    written: list[int] = []
    while not state.is_done:
        assert len(written) < BUDGET, TOKENIZER.decode(written)
        allowed = state.allowed()
        is_in_string = TOKENIZER.decode(written).count('"') % 2 == 1
        preferred = [t for t in (CLOSERS + DIGITS if is_in_string else DIGITS + CLOSERS) if allowed[t]]
        token_id = preferred[0] if preferred else int(allowed.nonzero()[0, 0])
        state.advance(token_id)
        written.append(token_id)
    return TOKENIZER.decode(written)


def longest_digit_run(text: str) -> int:
    runs = "".join(c if c.isdigit() or c in "-." else " " for c in text).split()
    return max((len(run) for run in runs), default=0)


@pytest.mark.parametrize("schema", SCHEMAS + [None], ids=lambda s: "json_object" if s is None else json.dumps(s))
def test_a_runaway_number_is_cut_and_the_document_closes(schema: dict[str, Any] | None) -> None:
    grammar = grammar_for("json_object", "") if schema is None else grammar_for("json_schema", json.dumps(schema))
    text = run_away(grammar)
    jsonschema.validate(json.loads(text), schema or {"type": "object"})
    assert 0 < longest_digit_run(text) <= MAX_NUMBER_CHARS


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_a_required_tool_call_always_closes(fmt: ToolCallFormat) -> None:
    parameters = {"type": "object", "properties": {"amount": {"type": "number", "minimum": 1, "maximum": 9},
                                                   "count": {"type": "integer"}},
                  "required": ["amount", "count"], "additionalProperties": False}
    grammar = grammar_for("grammar", fmt.grammar([ToolDef("pay", parameters)], False, {}))
    taken = fmt.take_calls(run_away(grammar))
    assert taken is not None
    calls, _ = taken
    assert len(calls) == 1 and calls[0].name == "pay"
    jsonschema.validate(json.loads(calls[0].arguments), parameters)


def test_numbers_within_the_bounds_still_pass_and_the_schema_is_only_narrowed() -> None:
    x_schema = {"type": "number", "minimum": -1e300, "maximum": 0.5}
    schema: dict[str, Any] = {"type": "object", "properties": {"x": x_schema}, "additionalProperties": True}
    bounded = bound_numbers(schema)
    x = bounded["properties"]["x"]
    assert x["minimum"] == -(10**MAX_INTEGER_DIGITS - 1) and x["maximum"] == 0.5 and "multipleOf" in x
    assert schema["properties"]["x"]["minimum"] == -1e300  # the client's schema is left as it was
    state = GrammarState(GRAMMARS, grammar_for("json_schema", json.dumps(schema)))
    for token_id in TOKENIZER.encode('{"x":-123456789012345.123456789,"y":[0.25]}', add_special_tokens=False):
        assert state.allowed()[token_id]
        state.advance(token_id)
    assert state.is_done
