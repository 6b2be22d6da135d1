"""`mooncaked sim cpp-study`: TTFT by prompt length with and without prefill groups, and its CLI."""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncaked.sim import cli
from mooncaked.sim.config import SimConfig, SimConfigError, with_overrides
from mooncaked.sim.cpp_study import format_table, new_tokens, parse_buckets, parse_groups, run_cpp_study
from mooncaked.sim.results import RequestRecord

BUCKETS = [2048, 32768]


def write_trace(path: Path, num_requests: int = 40, seed: int = 3) -> Path:
    """Short and long prompts 30 s apart (no queueing), no shared prefixes."""
    rng = random.Random(seed)
    lines, next_id = [], 0
    for i in range(num_requests):
        tokens = rng.randint(100, 2000) if i % 2 else rng.randint(8_000, 70_000)
        num_blocks = math.ceil(tokens / 512)
        lines.append(json.dumps({"timestamp": i * 30_000, "input_length": tokens,
                                 "output_length": rng.randint(1, 20),
                                 "hash_ids": list(range(next_id, next_id + num_blocks))}))
        next_id += num_blocks
    path.write_text("\n".join(lines) + "\n")
    return path


def small_cluster() -> SimConfig:
    return with_overrides(SimConfig(), "cluster", num_prefill=4, num_decode=2)


def test_groups_take_the_long_prompts_and_shorten_their_ttft(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl")
    study = run_cpp_study(str(trace), small_cluster(), [(1, 2)], BUCKETS)
    plain, grouped = study["variants"]["no_cpp"], study["variants"]["cpp_1x2"]
    assert grouped["num_prefill_groups"] == 1 and plain["num_prefill_groups"] == 0
    for variant in (plain, grouped):
        assert [row["bucket"] for row in variant["rows"]] == ["<= 2048", "2049-32768", "> 32768"]
        assert sum(row["num_requests"] for row in variant["rows"]) == variant["summary"]["num_served"] == 40
    assert all(row["pipelined_share"] == 0 for row in plain["rows"])
    short, _, longest = grouped["rows"]
    assert short["pipelined_share"] == 0  # under scheduler.cpp_min_tokens
    assert longest["num_requests"] > 0 and longest["pipelined_share"] == 1
    assert longest["ttft_mean_s"] < 0.75 * plain["rows"][2]["ttft_mean_s"]
    assert short["ttft_mean_s"] == pytest.approx(plain["rows"][0]["ttft_mean_s"])
    table = format_table(study).splitlines()
    assert len(table) == 2 + len(BUCKETS) + 1 + 1  # header, rule, buckets, all
    assert table[0].startswith("| prompt tokens | requests | no_cpp: mean / p90 TTFT (s) | no_cpp: over SLO |")
    assert table[-1].startswith("| all | 40 |")
    # no prompt shares a prefix: every prompt's tokens are all new
    for variant in (plain, grouped):
        by_new = [row["num_requests"] for row in variant["rows_by_new_tokens"]]
        assert by_new == [row["num_requests"] for row in variant["rows"]]
    assert format_table(study, "rows_by_new_tokens").startswith("| new tokens | requests |")


def test_new_tokens_are_the_prompt_less_the_reused_prefix() -> None:
    record = RequestRecord(0, 0.0, input_length=1500, output_length=1, num_blocks=3, prefix_blocks=2)
    assert new_tokens(record, 512) == 476
    whole = RequestRecord(1, 0.0, input_length=1024, output_length=1, num_blocks=2, prefix_blocks=2)
    assert new_tokens(whole, 512) == 1  # a fully cached prompt still computes its last token


@given(st.text(max_size=30))
def test_group_and_bucket_specs_parse_or_fail_with_a_message(text: str) -> None:
    for parse in (parse_groups, parse_buckets):
        try:
            parsed = parse(text)
        except SimConfigError as exc:
            assert "--groups" in str(exc) or "--buckets" in str(exc)
        else:
            assert parsed


def test_group_specs() -> None:
    assert parse_groups("4x2, 2x4") == [(4, 2), (2, 4)]
    assert parse_buckets("2048,8192") == [2048, 8192]
    for bad in ("4", "4x1", "0x2", "x2", "4x2,"):
        with pytest.raises(SimConfigError, match="--groups"):
            parse_groups(bad)
    for bad in ("", "8192,2048", "0", "2048,,4096"):
        with pytest.raises(SimConfigError, match="--buckets"):
            parse_buckets(bad)


def test_cli_cpp_study(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "t.jsonl", num_requests=12)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    out = tmp_path / "cpp.json"
    common = ["--trace", str(trace), "--no-progress", "--set", "cluster.num_prefill=4", "--set",
              "cluster.num_decode=2"]
    assert cli.run(parser.parse_args(["cpp-study", *common, "--groups", "1x2,1x4", "--buckets", "2048,32768",
                                      "--json", str(out)])) == 0
    data = json.loads(out.read_text())
    assert list(data["variants"]) == ["no_cpp", "cpp_1x2", "cpp_1x4"] and data["buckets"] == BUCKETS
    assert "| prompt tokens | requests |" in capsys.readouterr().out
    assert cli.run(parser.parse_args(["cpp-study", *common, "--groups", "3x2"])) == 2
    assert "cluster.num_prefill_groups: 6 group nodes" in capsys.readouterr().err
    assert cli.run(parser.parse_args(["cpp-study", *common, "--buckets", "10,5"])) == 2
    assert "--buckets" in capsys.readouterr().err
