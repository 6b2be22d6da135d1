"""A short run of `mooncaked bench layerwise` with a small model: every mode runs and the JSON is complete."""

from __future__ import annotations

import json
import os
from pathlib import Path

from mooncaked.bench.layerwise import MODES
from mooncaked.cli import main


def test_layerwise_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "layerwise.json"
    affinity = os.sched_getaffinity(0)
    assert main(["bench", "layerwise", "--model", "random:small", "--lengths", "256,384", "--rounds", "1",
                 "--json", str(out)]) == 0
    assert os.sched_getaffinity(0) == affinity, "the benchmark gives this thread its CPUs back"
    result = json.loads(out.read_text())
    assert set(result["lengths"]) == {"256", "384"}
    for row in result["lengths"].values():
        assert all(row[f"{mode}_s"] > 0 and row[f"{mode}_stall_s"] >= 0 for mode in MODES)
        assert all(row[f"{mode}_layer_s"] > 0 for mode in MODES if mode != "transfer")
        assert row["kv_bytes"] > 0 and row["num_prefix_blocks"] >= 1
        assert row["in_pages_s"] < row["no_prefix_s"] * 2
    for key in ("layerwise_overhead", "serialized_overhead", "load_hidden_fraction"):
        assert key in result
    assert result["setup"]["copy_cpus"] and result["setup"]["num_threads"] == len(result["setup"]["compute_cpus"])
