"""A short run of `mooncaked bench tiers` with the tiny model: every case reuses its hot prefix from the tier it
names (the device tier's metric counts exactly the device case's blocks), and int8 blocks are smaller."""

from __future__ import annotations

import json
from pathlib import Path

from mooncaked.cli import main


def test_tiers_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "tiers.json"
    assert main(["bench", "tiers", "--model", "random:tiny", "--tokens", "160", "--block-size", "16",
                 "--rounds", "1", "--cache-dtypes", "auto,int8", "--hot-fraction", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    auto, int8 = result["runs"]
    assert (auto["cache_dtype"], int8["cache_dtype"]) == ("auto", "int8")
    for run in (auto, int8):
        cases = run["cases"]
        assert set(cases) == {"none", "device", "host_store", "remote_store"}
        assert cases["none"]["num_reused_tokens"] == 0
        for case in ("device", "host_store", "remote_store"):
            assert cases[case]["num_hot_blocks"] == 9 and cases[case]["num_reused_tokens"] == 9 * 16  # all but one
        assert cases["remote_store"]["num_fetched_blocks"] == 9 and cases["host_store"]["num_fetched_blocks"] == 0
        assert run["device_prefix_blocks"] == 9  # the device case's blocks, and no other case's
        assert run["pool_tokens"] == (1 << 30) // run["bytes_per_block"] * 16
    # tiny: head_dim 16, fp32 -> 64 bytes a row, int8 18
    assert int8["bytes_per_block"] * 64 == auto["bytes_per_block"] * 18
    assert auto["logprob_error_nats"] == 0.0 and 0.0 < int8["logprob_error_nats"] < 0.05
