"""`mooncaked bench kernels` and `mooncaked bench layerwise --device cuda` run on a GPU (small shapes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mooncaked.cli import main

pytestmark = pytest.mark.gpu


def test_bench_kernels_runs_on_the_device(tmp_path: Path) -> None:
    out = tmp_path / "kernels.json"
    assert main(["bench", "kernels", "--prefill-tokens", "1024", "--decode-batches", "1,4",
                 "--decode-contexts", "1024", "--rep-ms", "20", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert all(row["max_abs_err_vs_sdpa"] < 5e-2 for row in result["prefill"])
    assert all(row["max_abs_err_vs_reference"] < 5e-2 for row in result["decode"])


def test_bench_layerwise_runs_on_the_device(tmp_path: Path) -> None:
    out = tmp_path / "layerwise.json"
    assert main(["bench", "layerwise", "--device", "cuda", "--model", "random:small", "--lengths", "256",
                 "--rounds", "1", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["lengths"]["256"]
    assert row["load_layerwise_s"] > 0 and row["transfer_s"] > 0
