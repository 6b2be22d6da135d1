"""Constrained decoding with llguidance: which tokens a request's grammar allows next (docs/api.md#structured-outputs).

1. `GrammarTokenizer(tokenizer, vocab_size, eos_token_ids)` is llguidance's view of the model's vocabulary, built
   once per process (about 0.4 s for SmolLM2's 49,152 tokens).
2. `grammar_for(kind, value)` turns a request's constraint (a JSON schema, any JSON object, a regular expression, a
   choice of strings, a Lark or GBNF grammar) into llguidance's grammar text, the form that travels to the
   workers (a JSON one with its numbers bounded in length, model/json_bounds.py, so a document always closes);
   `GrammarTokenizer.check(grammar)` says why one cannot be served ("" when it can): llguidance's own check, then
   every character the grammar may force must be one the tokenizer can produce.
3. `GrammarState(tokenizer, grammar, output_ids)` is one sequence's matcher, rebuilt from the tokens it already
   produced: a decode instance, or a migrated leg, starts from the output so far, never from a shipped state.
   `allowed()` is the mask of tokens that may come next (computed in Rust with the GIL released, so a mask thread
   overlaps it with the forward), `logit_mask()` the same as 0 / -inf to add to the logits; `advance(token_id)`
   consumes a sampled token; `is_done` once nothing but EOS may follow. A token the grammar refuses raises
   GrammarError (the sampler never draws one: a bug or a foreign output).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

import llguidance
import torch
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the type stubs only

from mooncaked.model.json_bounds import bound_numbers
from mooncaked.model.tokenizer import TextTokenizer

KIND_JSON_SCHEMA = "json_schema"
KIND_JSON_OBJECT = "json_object"
KIND_REGEX = "regex"
KIND_CHOICE = "choice"
KIND_GRAMMAR = "grammar"
GRAMMAR_KINDS = (KIND_JSON_SCHEMA, KIND_JSON_OBJECT, KIND_REGEX, KIND_CHOICE, KIND_GRAMMAR)
_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)
# compact JSON (no whitespace between items): a model may not wander off into endless whitespace, which flexible
# whitespace lets a small or unsure one do until max_tokens; a schema's "x-guidance" options may set it otherwise
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A constraint that cannot be compiled or followed; the message says why."""


def grammar_for(kind: str, value: str) -> str:
    """llguidance's grammar text for a constraint: `value` is the schema's JSON text (json_schema), the pattern
    (regex), the JSON list of strings (choice), or the grammar in Lark or GBNF (grammar); json_object takes none."""
    try:
        if kind == KIND_JSON_SCHEMA:
            schema = json.loads(value)
            schema = bound_numbers(schema) if isinstance(schema, dict) else schema
            return str(llguidance.LLMatcher.grammar_from_json_schema(schema, JSON_OPTIONS))
        if kind == KIND_JSON_OBJECT:
            return str(llguidance.LLMatcher.grammar_from_json_schema(bound_numbers({"type": "object"}), JSON_OPTIONS))
        if kind == KIND_REGEX:
            return str(llguidance.LLMatcher.grammar_from_regex(value))
        if kind == KIND_CHOICE:
            choices = json.loads(value)
            literals = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)
            return str(llguidance.LLMatcher.grammar_from_lark(f"start: {literals}"))
        if kind == KIND_GRAMMAR:
            return str(llguidance.LLMatcher.grammar_from_lark(any_to_lark(value)))
    except (ValueError, TypeError, GbnfToLarkError) as exc:
        raise GrammarError(str(exc)) from None
    raise GrammarError(f"unknown constraint kind {kind!r}; one of {GRAMMAR_KINDS}")


def after_prefix(prefix_lark: str, grammar: str) -> str:
    """A grammar that runs `prefix_lark` (Lark whose `start` refers to `@answer`, model/reasoning.py) and then
    `grammar` (llguidance's grammar text: its JSON document, or Lark)."""
    document = json.loads(grammar) if grammar.lstrip().startswith("{") else {"grammars": [{"lark_grammar": grammar}]}
    answer, *others = document["grammars"]
    return json.dumps({**document, "grammars": [{"lark_grammar": prefix_lark}, {**answer, "name": "answer"},
                                                 *others]}, ensure_ascii=False)


class GrammarTokenizer:
    """Shared by every grammar state of a process; immutable after construction but for the memo of which
    characters the tokenizer can produce (grown by `check`, on the conductor's event loop only)."""

    def __init__(self, tokenizer: TextTokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size  # the logits' width: tokens past the tokenizer's are never allowed
        self.lltokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                                  eos_token=list(eos_token_ids) or None)
        self._is_producible: dict[str, bool] = {}

    def check(self, grammar: str) -> str:
        """Why `grammar` cannot be served, "" when it can."""
        if error := str(llguidance.LLMatcher.validate_grammar(grammar, self.lltokenizer)):
            return error
        for char in sorted(set(_literal_text(grammar))):
            if not char.isascii() and not self._produces(char):
                return (f"it contains {char!r} (U+{ord(char):04X}), which this model's tokenizer cannot produce "
                        f"(its vocabulary has no token for some of the character's bytes): leave it out")
        return ""

    def _produces(self, char: str) -> bool:
        """Whether the vocabulary's tokens can spell `char`'s UTF-8 bytes, as llguidance's token trie sees them (no
        normalizer in the way; a byte-level vocabulary may lack bytes: SmolLM2's has no token for the UTF-8 lead
        bytes of U+40000..U+BFFFF, so a grammar forcing such a character can never be followed)."""
        is_producible = self._is_producible.get(char)
        if is_producible is None:
            spelled = self.lltokenizer.decode_bytes(self.lltokenizer.greedy_tokenize(char))
            is_producible = self._is_producible[char] = spelled == char.encode()
        return is_producible


def _literal_text(grammar: str) -> str:
    """Every string of a grammar in llguidance's JSON form (its schemas' keys, enums, constants, patterns; the Lark
    text of its Lark grammars), or the grammar text itself: what a grammar may force the model to write."""
    try:
        document = json.loads(grammar)
    except ValueError:
        return grammar
    strings: list[str] = []
    pending: list[object] = [document]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            strings.append(item)
        elif isinstance(item, dict):
            strings.extend(str(key) for key in item)
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return "".join(strings)


class GrammarState:
    """Owned by one sequence on the instance sampling it; used by one thread at a time."""

    def __init__(self, tokenizer: GrammarTokenizer, grammar: str, output_ids: Sequence[int] = ()) -> None:
        self.vocab_size = tokenizer.vocab_size
        self._matcher = llguidance.LLMatcher(tokenizer.lltokenizer, grammar, log_level=0)  # errors: is_error()
        self._bits = torch.zeros((tokenizer.vocab_size + 31) // 32, dtype=torch.int32)
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error())
        for token_id in output_ids:
            self.advance(token_id)

    @property
    def is_done(self) -> bool:
        """Nothing but EOS may follow: the output is complete."""
        return bool(self._matcher.is_stopped())

    def advance(self, token_id: int) -> None:
        if not self._matcher.consume_token(token_id):
            raise GrammarError(f"token {token_id} does not follow the grammar: {self._matcher.get_error()}")

    def allowed(self) -> torch.Tensor:
        """bool [vocab]: the tokens that may come next."""
        self._matcher.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error())
        bits = (self._bits.unsqueeze(-1) >> _BIT_SHIFTS) & 1
        return bits.flatten()[: self.vocab_size].bool()

    def logit_mask(self) -> torch.Tensor:
        """fp32 [vocab]: 0 for the tokens that may come next, -inf for the others; added to a row of logits (the
        costly part of masking, done here on the mask thread rather than on the compute thread's critical path)."""
        return torch.zeros(self.vocab_size).masked_fill_(~self.allowed(), float("-inf"))
