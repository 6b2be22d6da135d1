"""A short real run of `mooncaked bench rpc`: all three systems, tiny counts, JSON written."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from mooncaked.bench import rpc as bench_rpc


def test_bench_rpc_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench_rpc.add_arguments(parser)
    out = tmp_path / "rpc.json"
    args = parser.parse_args(["--seconds", "0.3", "--warmup-s", "0.1", "--concurrency", "8", "--rounds", "1",
                              "--json", str(out)])
    assert bench_rpc.run(args) == 0
    result = json.loads(out.read_text())
    for system in ("rpc", "http", "echo"):
        assert result[f"{system}_calls_per_s"] > 0
        assert 0 < result[f"{system}_p50_ms"] <= result[f"{system}_p99_ms"]
    assert result["ratio"] == pytest.approx(result["rpc_calls_per_s"] / result["http_calls_per_s"], rel=0.02)
    assert result["ratio_vs_echo"] > 0
    table = capsys.readouterr().out
    assert "ratio_vs_echo" in table and "http" in table


def test_bench_rpc_refuses_unknown_systems(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench_rpc.add_arguments(parser)
    assert bench_rpc.run(parser.parse_args(["--systems", "rpc,grpc"])) == 2
    assert "grpc" in capsys.readouterr().err
