"""Smoke test of `mooncaked bench model` on a tiny random model (the real run uses SmolLM2 and takes minutes)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from mooncaked.bench import model as bench_model

pytest.importorskip("transformers")


def test_bench_model_writes_every_metric(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench_model.add_arguments(parser)
    out = tmp_path / "model.json"
    args = parser.parse_args(["--model", "random:tiny", "--new-tokens", "4", "--batch-sizes", "1,3",
                              "--prefill-tokens", "40", "--block-size", "16", "--repeats", "1", "--threads", "1",
                              "--json", str(out)])
    assert bench_model.run(args) == 0
    results = json.loads(out.read_text())
    for b in (1, 3):
        assert results[f"ours_tok_s_b{b}"] > 0 and results[f"hf_tok_s_b{b}"] > 0
        assert results[f"ratio_b{b}"] == pytest.approx(results[f"ours_tok_s_b{b}"] / results[f"hf_tok_s_b{b}"])
        assert results[f"tokens_match_b{b}"] >= 0.75  # same weights, same greedy tokens (up to fp near-ties)
    assert results["prefill_tokens"] == 40 and "callback_overhead" in results
    assert "ratio" in capsys.readouterr().out


def test_bench_model_moe_writes_every_metric(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench_model.add_arguments(parser)
    out = tmp_path / "moe.json"
    args = parser.parse_args(["--model", "moe", "--new-tokens", "3", "--batch-sizes", "1,2", "--repeats", "1",
                              "--threads", "1", "--json", str(out)])
    assert bench_model.run(args) == 0
    results = json.loads(out.read_text())
    for b in (1, 2):
        assert results[f"ratio_b{b}"] == pytest.approx(results[f"ours_tok_s_b{b}"] / results[f"hf_tok_s_b{b}"])
        assert results[f"tokens_match_b{b}"] >= 2 / 3  # the same checkpoint in transformers: its greedy tokens
        assert results[f"moe_step_ms_b{b}"] > 0 and results[f"dense_step_ms_b{b}"] > 0
        assert results[f"moe_active_cost_ratio_b{b}"] == pytest.approx(
            results[f"moe_step_ms_b{b}"] / results[f"dense_step_ms_b{b}"])
    assert results["moe_active_cost_ratio"] == results["moe_active_cost_ratio_b1"]
    assert len(results["load_average"]) == 3 and "moe/dense" in capsys.readouterr().out
