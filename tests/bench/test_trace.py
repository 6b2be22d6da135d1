"""Trace replay prompt synthesis: equal hash ids give equal token prefixes; lengths and times scale."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mooncaked.bench.trace import (
    TokenBlocks, TraceRecord, load_trace, poisson_arrivals, random_requests, tokens_to_text, trace_requests,
)


def write_trace(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_equal_hash_ids_give_equal_prefixes(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 1000, "input_length": 1300, "output_length": 10, "hash_ids": [1, 2, 3]},
        {"timestamp": 1500, "input_length": 1100, "output_length": 20, "hash_ids": [1, 2, 9]},
        {"timestamp": 3000, "input_length": 600, "output_length": 5, "hash_ids": [7, 8]},
    ])
    blocks = TokenBlocks(block_tokens=16, vocab_size=1000, seed=0)
    requests = trace_requests(load_trace(trace), blocks, speed=2.0, output_scale=0.5)
    first, second, third = requests
    assert len(first.token_ids) == round(1300 * 16 / 512) == 41
    assert len(second.token_ids) == round(1100 * 16 / 512) == 34
    assert first.token_ids[:32] == second.token_ids[:32]
    assert first.token_ids[32:34] != second.token_ids[32:34]
    assert third.token_ids[:16] != first.token_ids[:16]
    assert [r.arrival_s for r in requests] == [0.0, 0.25, 1.0]
    assert [r.max_tokens for r in requests] == [5, 10, 2]
    assert all(blocks.low_token_id <= t < 1000 for r in requests for t in r.token_ids)


def test_blocks_are_fixed_across_runs_and_seeded() -> None:
    one = TokenBlocks(block_tokens=8, vocab_size=500, seed=3)
    two = TokenBlocks(block_tokens=8, vocab_size=500, seed=3)
    other = TokenBlocks(block_tokens=8, vocab_size=500, seed=4)
    assert one.block(42) == two.block(42) and len(one.block(42)) == 8
    assert one.block(42) != one.block(43)
    assert one.block(42) != other.block(42)


def test_short_hash_ids_pad_and_max_input_len_cuts() -> None:
    blocks = TokenBlocks(block_tokens=4, vocab_size=100, seed=0)
    record = TraceRecord(timestamp_ms=0, input_length=512 * 3, output_length=1, hash_ids=(5,))
    (request,) = trace_requests([record], blocks)
    assert len(request.token_ids) == 12 and request.token_ids[:4] == blocks.block(5)
    (cut,) = trace_requests([record], blocks, max_input_len=6)
    assert cut.token_ids == request.token_ids[:6]


def test_bad_trace_lines_name_the_line(tmp_path: Path) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n{"timestamp": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_trace(trace)
    assert len(load_trace(trace, limit=1)) == 1


def test_random_requests_and_poisson_arrivals() -> None:
    blocks = TokenBlocks(block_tokens=16, vocab_size=1000, seed=1)
    requests = random_requests(4, input_len=10, output_len=3, request_rate=float("inf"), blocks=blocks)
    assert [len(r.token_ids) for r in requests] == [10] * 4 and requests[0].token_ids != requests[1].token_ids
    assert all(r.arrival_s == 0.0 and r.max_tokens == 3 for r in requests)
    arrivals = poisson_arrivals(2000, request_rate=50.0, seed=0)
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    assert arrivals[-1] / len(arrivals) == pytest.approx(1 / 50.0, rel=0.1)
    assert tokens_to_text([1, 2, 1]).split()[0] == tokens_to_text([1]).strip()
