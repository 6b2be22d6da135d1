"""A short run of `mooncaked bench prefix` with the tiny model: every case runs, reusing and fetching the
blocks it should, and the JSON is complete."""

from __future__ import annotations

import json
from pathlib import Path

from mooncaked.cli import main


def test_prefix_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "prefix.json"
    assert main(["bench", "prefix", "--model", "random:tiny", "--tokens", "160", "--block-size", "16",
                 "--rounds", "1", "--threads", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["num_blocks"] == 10 and result["block_size"] == 16
    cases = result["cases"]
    assert set(cases) == {"local_0", "local_50", "local_95", "remote_50", "remote_95"}
    expected_blocks = {"local_0": 0, "local_50": 5, "local_95": 9, "remote_50": 5, "remote_95": 9}
    for name, row in cases.items():
        assert row["num_cached_blocks"] == expected_blocks[name]
        assert row["num_reused_tokens"] == expected_blocks[name] * 16
        assert row["num_fetched_blocks"] == (expected_blocks[name] if row["where"] == "remote" else 0)
        assert row["ttft_s"] > 0 and row["ratio"] > 0 and len(row["ttft_s_runs"]) == 1
    assert cases["local_0"]["ratio"] == 1.0
    assert result["ratio_local_95"] == cases["local_95"]["ratio"]
    assert result["ratio_remote_95"] == cases["remote_95"]["ratio"]
