"""Prompts for the load generator: Mooncake trace replay and random synthetic prompts.

1. `load_trace` reads Mooncake JSONL (`timestamp` ms, `input_length`, `output_length`, `hash_ids`: one id
   per 512-token block of the prompt; equal ids mean equal blocks, hence shared prefixes).
2. `TokenBlocks` maps each hash id to one fixed pseudo-random block of token ids, seeded by (seed, id), so
   equal ids give equal token blocks in every run.
3. `trace_requests` scales each record to the model: a trace block becomes `block_scale` tokens, the prompt
   length scales the same way, output length by `output_scale`, arrival times divide by `speed`.
   `random_requests` makes prompts that share nothing, arriving as a Poisson process.
Token ids are drawn from [vocab_size // 16, vocab_size) to stay clear of the low ids where tokenizers keep
their special tokens.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TRACE_BLOCK_TOKENS = 512
WORDS = (
    "the of and to in is was for on that with as by at from his her are were which this have had not but "
    "one all new more time year people way day man thing woman life child world school state family "
    "student group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot right study"
).split()


@dataclass(frozen=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class BenchRequest:
    """One request of a benchmark run: when to send it and what."""

    index: int
    arrival_s: float  # from the start of the run
    token_ids: tuple[int, ...]
    max_tokens: int


def load_trace(path: str | Path, *, limit: int | None = None) -> list[TraceRecord]:
    records: list[TraceRecord] = []
    with open(path, encoding="utf-8") as lines:
        for line_number, line in enumerate(lines, start=1):
            if limit is not None and len(records) >= limit:
                break
            if line.strip():
                records.append(_parse_record(line, f"{path}:{line_number}"))
    return records


def _parse_record(line: str, where: str) -> TraceRecord:
    try:
        row = json.loads(line)
        record = TraceRecord(
            timestamp_ms=float(row["timestamp"]),
            input_length=int(row["input_length"]),
            output_length=int(row["output_length"]),
            hash_ids=tuple(int(h) for h in row["hash_ids"]),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{where}: not a Mooncake trace record "
                         f"(timestamp, input_length, output_length, hash_ids): {exc!r}") from None
    if record.input_length < 1 or record.output_length < 1:
        raise ValueError(f"{where}: input_length and output_length must be positive")
    return record


class TokenBlocks:
    """Owns the cache of hash id -> token block; every block is a pure function of (seed, hash id)."""

    def __init__(self, *, block_tokens: int, vocab_size: int, seed: int) -> None:
        if block_tokens < 1 or vocab_size < 16:
            raise ValueError("block_tokens must be >= 1 and vocab_size >= 16")
        self.block_tokens = block_tokens
        self.low_token_id = vocab_size // 16
        self.vocab_size = vocab_size
        self.seed = seed
        self.blocks: dict[int, tuple[int, ...]] = {}

    def block(self, hash_id: int) -> tuple[int, ...]:
        block = self.blocks.get(hash_id)
        if block is None:
            block = self.random_tokens(self.block_tokens, (hash_id,))
            self.blocks[hash_id] = block
        return block

    def random_tokens(self, num_tokens: int, key: tuple[int, ...]) -> tuple[int, ...]:
        rng = np.random.default_rng([self.seed, *[k & 0xFFFFFFFFFFFF for k in key], len(key)])
        return tuple(int(t) for t in rng.integers(self.low_token_id, self.vocab_size, size=num_tokens))

    def prompt(self, hash_ids: Sequence[int], num_tokens: int, *, request_index: int) -> tuple[int, ...]:
        """The blocks of `hash_ids` in order, cut to `num_tokens`; padded with tokens unique to the request
        when the ids cover fewer tokens (traces where they do not cover the whole prompt)."""
        tokens = [t for hash_id in hash_ids for t in self.block(hash_id)][:num_tokens]
        if len(tokens) < num_tokens:
            tokens.extend(self.random_tokens(num_tokens - len(tokens), (request_index, -1)))
        return tuple(tokens)


def trace_requests(
    records: Sequence[TraceRecord], blocks: TokenBlocks, *, speed: float = 1.0, output_scale: float = 1.0,
    max_input_len: int | None = None,
) -> list[BenchRequest]:
    if speed <= 0 or output_scale <= 0:
        raise ValueError("speed and output_scale must be positive")
    start_ms = min((r.timestamp_ms for r in records), default=0.0)
    requests = []
    for index, record in enumerate(records):
        num_tokens = max(1, round(record.input_length * blocks.block_tokens / TRACE_BLOCK_TOKENS))
        if max_input_len is not None:
            num_tokens = min(num_tokens, max_input_len)
        requests.append(BenchRequest(
            index=index,
            arrival_s=(record.timestamp_ms - start_ms) / 1e3 / speed,
            token_ids=blocks.prompt(record.hash_ids, num_tokens, request_index=index),
            max_tokens=max(1, round(record.output_length * output_scale)),
        ))
    return requests


def poisson_arrivals(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Arrival times (s) of a Poisson process at `request_rate` per second; all at 0 for an infinite rate."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if request_rate <= 0:
        raise ValueError("request_rate must be positive")
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, size=num_requests)
    return [float(t) for t in np.cumsum(gaps) - gaps[0]]


def random_requests(
    num_requests: int, *, input_len: int, output_len: int, request_rate: float, blocks: TokenBlocks
) -> list[BenchRequest]:
    arrivals = poisson_arrivals(num_requests, request_rate, blocks.seed)
    return [
        BenchRequest(index=i, arrival_s=arrivals[i], token_ids=blocks.random_tokens(input_len, (i, -2)),
                     max_tokens=output_len)
        for i in range(num_requests)
    ]


def tokens_to_text(token_ids: Sequence[int]) -> str:
    """A deterministic word string standing in for token ids on the chat endpoint (equal ids, equal text)."""
    return " ".join(WORDS[t % len(WORDS)] for t in token_ids)
