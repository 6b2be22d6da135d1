"""Measure the grammar engines structured outputs could use: per-token mask cost and compile time on this CPU,
with the embedded SmolLM2 tokenizer (docs/api.md#structured-outputs records the result and the choice).

    python scripts/grammar_mask_cost.py [--rounds 3]

For each engine installed (llguidance, xgrammar) and each schema: build the tokenizer information once, compile the
schema (a fresh compiler each round: a schema never seen), then walk the tokens of a valid answer, computing the
full-vocabulary mask before each token and advancing by it; every token must be allowed. Prints medians of the
compile plus the first mask (what a new schema adds to TTFT) and of the later tokens' mask and advance.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from mooncaked.model.frontend import EMBEDDED_SMOLLM2, load_frontend

SCHEMAS: list[tuple[str, dict[str, Any], Any]] = [
    ("flat", {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False},
     {"name": "Ada Lovelace", "age": 36}),
    ("nested", {
        "type": "object", "additionalProperties": False, "required": ["city", "days", "units"],
        "properties": {
            "city": {"type": "string"},
            "units": {"enum": ["metric", "imperial"]},
            "days": {"type": "array", "minItems": 1, "maxItems": 7, "items": {
                "type": "object", "additionalProperties": False, "required": ["day", "high", "low", "rain"],
                "properties": {"day": {"type": "integer", "minimum": 1, "maximum": 31},
                               "high": {"type": "number", "minimum": -60, "maximum": 60},
                               "low": {"type": "number", "minimum": -60, "maximum": 60},
                               "rain": {"type": "boolean"}}}}}},
     {"city": "Lisbon", "units": "metric", "days": [{"day": d, "high": 20.5, "low": 12, "rain": d % 2 == 0}
                                                     for d in range(1, 8)]}),
]

# (schema, tokens) -> (compile and the first mask, the mean of the later tokens' mask and advance), in seconds
Walk = Callable[[dict[str, Any], list[int]], tuple[float, float]]


def llguidance_walker(tokenizer_json: str, vocab_size: int, eos_id: int) -> Walk:
    import llguidance

    tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_id)
    mask = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)

    def walk(schema: dict[str, Any], tokens: list[int]) -> tuple[float, float]:
        started = time.perf_counter()
        matcher = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(schema))
        assert not matcher.is_error(), matcher.get_error()
        first = 0.0
        for index, token in enumerate(tokens):
            matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
            first = first or time.perf_counter()
            assert (int(mask[token // 32]) >> (token % 32)) & 1, f"token {token} masked"
            assert matcher.consume_token(token), matcher.get_error()
        return first - started, (time.perf_counter() - first) / (len(tokens) - 1)
    return walk


def xgrammar_walker(tokenizer_json: str, vocab_size: int, eos_id: int) -> Walk:
    import transformers
    import xgrammar
    from tokenizers import Tokenizer

    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json))
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=[eos_id])
    mask = xgrammar.allocate_token_bitmask(1, vocab_size)

    def walk(schema: dict[str, Any], tokens: list[int]) -> tuple[float, float]:
        started = time.perf_counter()
        compiled_grammar = xgrammar.GrammarCompiler(info, cache_enabled=False).compile_json_schema(json.dumps(schema))
        matcher = xgrammar.GrammarMatcher(compiled_grammar)
        first = 0.0
        for token in tokens:
            matcher.fill_next_token_bitmask(mask)
            first = first or time.perf_counter()
            assert (int(mask[0, token // 32]) >> (token % 32)) & 1, f"token {token} masked"
            assert matcher.accept_token(token)
        return first - started, (time.perf_counter() - first) / (len(tokens) - 1)
    return walk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    frontend = load_frontend(EMBEDDED_SMOLLM2)
    tokenizer = frontend.tokenizer
    tokenizer_json = tokenizer.backend.to_str()
    vocab_size, eos_id = frontend.args.vocab_size, frontend.eos_token_ids[0]
    print(f"SmolLM2 tokenizer: {vocab_size} tokens; torch {torch.__version__}, 1 thread")
    for engine, make in (("llguidance", llguidance_walker), ("xgrammar", xgrammar_walker)):
        if importlib.util.find_spec(engine) is None:
            print(f"{engine}: not installed")
            continue
        started = time.perf_counter()
        walk = make(tokenizer_json, vocab_size, eos_id)
        print(f"{engine}: tokenizer information {time.perf_counter() - started:.2f} s")
        for name, schema, answer in SCHEMAS:
            tokens = tokenizer.encode(json.dumps(answer), add_special_tokens=False)
            runs = [walk(schema, tokens) for _ in range(args.rounds)]
            compile_ms = statistics.median(c for c, _ in runs) * 1e3
            token_us = statistics.median(t for _, t in runs) * 1e6
            print(f"  {name:7s} {len(tokens):3d} tokens: compile + first mask {compile_ms:6.2f} ms, "
                  f"then mask + advance {token_us:6.1f} us/token")


if __name__ == "__main__":
    main()
