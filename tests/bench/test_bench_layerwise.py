"""A short run of `mooncaked bench layerwise` with the tiny model: every mode runs and the JSON is complete."""

from __future__ import annotations

import json
from pathlib import Path

from mooncaked.cli import main


def test_layerwise_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "layerwise.json"
    assert main(["bench", "layerwise", "--model", "random:tiny", "--lengths", "64,128", "--rounds", "1",
                 "--threads", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["lengths"]) == {"64", "128"}
    for row in result["lengths"].values():
        assert row["none_s"] > 0 and row["layerwise_s"] > 0 and row["serialized_s"] > 0
        assert row["kv_bytes"] > 0
    assert "layerwise_overhead" in result and "serialized_overhead" in result
