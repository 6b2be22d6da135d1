"""The conductor's side of structured outputs: a request's constraint compiled into llguidance's grammar text and
checked against the model's vocabulary once, before anything is placed (docs/api.md#structured-outputs).

1. `GrammarCache(tokenizer)` is built with the backend (the tokenizer: model/grammar.py's, made at start).
2. `grammar_text(constraint)` returns the grammar text that rides the wire sampling spec, or raises the 400 naming
   the constraint's field when it does not compile. Answers, refusals included, are kept for the last
   `CACHE_SIZE` distinct constraints, so a schema seen before costs a dictionary lookup (agents send the same few
   schemas again and again).
"""

from __future__ import annotations

from collections import OrderedDict

from mooncaked.api.errors import invalid_field
from mooncaked.api.structured import OutputConstraint
from mooncaked.model.grammar import GrammarError, GrammarTokenizer, after_prefix, grammar_for

CACHE_SIZE = 256


class GrammarCache:
    """Owns the cache of compiled constraints (used from the event loop only)."""

    def __init__(self, tokenizer: GrammarTokenizer) -> None:
        self.tokenizer = tokenizer
        self._answers: OrderedDict[tuple[str, str, str], tuple[str, str]] = OrderedDict()  # -> (grammar, error)
        self.num_compiled = 0

    def grammar_text(self, constraint: OutputConstraint, prefix_lark: str = "") -> str:
        """`prefix_lark`: Lark run before the constraint (a thinking model's free reasoning: model/reasoning.py)."""
        key = (constraint.kind, constraint.value, prefix_lark)
        answer = self._answers.get(key)
        if answer is None:
            answer = self._compile(constraint, prefix_lark)
            self._answers[key] = answer
            if len(self._answers) > CACHE_SIZE:
                self._answers.popitem(last=False)
        else:
            self._answers.move_to_end(key)
        grammar, error = answer
        if error:
            raise invalid_field(constraint.param, f"the output constraint cannot be served: {error}")
        return grammar

    def _compile(self, constraint: OutputConstraint, prefix_lark: str) -> tuple[str, str]:
        self.num_compiled += 1
        try:
            grammar = grammar_for(constraint.kind, constraint.value)
        except GrammarError as exc:
            return "", str(exc)
        if prefix_lark:
            grammar = after_prefix(prefix_lark, grammar)
        error = self.tokenizer.check(grammar)
        return ("", error.strip()) if error else (grammar, "")
