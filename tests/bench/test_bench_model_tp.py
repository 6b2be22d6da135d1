"""Smoke test of `mooncaked bench model --tp 2` on a tiny random model (the real run uses a SmolLM2-sized one)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from mooncaked.bench import model as bench_model


def test_bench_model_tp_prints_both_speedups(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench_model.add_arguments(parser)
    out = tmp_path / "tp.json"
    args = parser.parse_args(["--model", "random:tiny", "--tp", "2", "--prefill-tokens", "40", "--decode-batch", "3",
                              "--decode-context", "10", "--new-tokens", "3", "--block-size", "8", "--repeats", "1",
                              "--json", str(out)])
    assert bench_model.run(args) == 0
    results = json.loads(out.read_text())
    for name in ("prefill", "decode"):
        speedup = results[f"tp_{name}_speedup"]
        assert results[f"tp_{name}_speedup_min"] <= speedup <= results[f"tp_{name}_speedup_max"]
        assert speedup > 0 and results[f"tp1_{name}_ms"] > 0 and results[f"tp2_{name}_ms"] > 0
    assert results["tokens_match"] == 1.0  # the same greedy tokens at TP=1 and TP=2
    assert results["tp"] == 2 and len(results["load_average"]) == 3
    assert '"tp_decode_speedup"' in capsys.readouterr().out
