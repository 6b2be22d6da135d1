"""The conductor's compiled constraints (roles/conductor/grammars.py): compiled once per distinct constraint,
refusals included, and a refusal is a 400 naming the request's field."""

from __future__ import annotations

import json

import pytest

from mooncaked.api.errors import ApiError
from mooncaked.api.structured import OutputConstraint
from mooncaked.model.grammar import GrammarTokenizer
from mooncaked.model.tokenizer import byte_level_test_tokenizer
from mooncaked.roles.conductor.grammars import CACHE_SIZE, GrammarCache


@pytest.fixture(scope="module")
def tokenizer() -> GrammarTokenizer:
    return GrammarTokenizer(byte_level_test_tokenizer(), 320, [2])


def test_a_constraint_seen_before_is_not_compiled_again(tokenizer: GrammarTokenizer) -> None:
    cache = GrammarCache(tokenizer)
    schema = OutputConstraint("json_schema", json.dumps({"type": "object"}), "guided_json")
    first = cache.grammar_text(schema)
    assert cache.grammar_text(OutputConstraint(schema.kind, schema.value, "response_format.json_schema.schema")) \
        == first
    assert cache.num_compiled == 1
    bad = OutputConstraint("regex", "[a-z", "guided_regex")
    for param in ("guided_regex", "structured_outputs.regex"):
        with pytest.raises(ApiError) as raised:
            cache.grammar_text(OutputConstraint(bad.kind, bad.value, param))
        assert raised.value.status == 400 and raised.value.param == param and "unclosed" in raised.value.message
    assert cache.num_compiled == 2


def test_the_cache_keeps_the_most_recent_constraints(tokenizer: GrammarTokenizer) -> None:
    cache = GrammarCache(tokenizer)
    constraints = [OutputConstraint("regex", f"a{{{n}}}", "guided_regex") for n in range(CACHE_SIZE + 1)]
    for constraint in constraints:
        cache.grammar_text(constraint)
    cache.grammar_text(constraints[-1])
    assert cache.num_compiled == CACHE_SIZE + 1
    cache.grammar_text(constraints[0])  # the oldest went first
    assert cache.num_compiled == CACHE_SIZE + 2
