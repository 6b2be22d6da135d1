"""A short run of `mooncaked bench pd` with the tiny model: both layouts start as `--role all` process trees,
serve the mixed workload at one rate, stop cleanly, and the JSON is complete. Most of its time is the two
clusters' start-up (one process per role)."""

from __future__ import annotations

import json
from pathlib import Path

from mooncaked.bench.pd import KEPT_METRICS
from mooncaked.cli import main


def test_pd_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "pd.json"
    assert main(["bench", "pd", "--model", "random:tiny", "--vocab-size", "320", "--rates", "3",
                 "--duration-s", "2", "--tail-s", "10", "--max-requests", "6", "--chat-tokens", "20",
                 "--doc-tokens", "150", "--doc-every", "3", "--output-tokens", "6", "--tbt-slo-ms", "1000",
                 "--no-progress", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["tbt_slo_ms"] == 1000 and result["tbt_slo_basis"] == "given"
    assert set(result["layouts"]) == {"disaggregated", "colocated"}
    for layout in result["layouts"].values():
        assert layout["clean_exit"]
        assert layout["probe"]["median_itl_ms"] > 0 and layout["probe"]["doc_ttft_ms"] > 0
        row = layout["rates"]["3"]
        assert set(KEPT_METRICS) <= set(row)
        assert row["num_requests"] >= 3 and row["completed"] == row["num_requests"] and row["errors"] == []
        assert row["p90_ttft_doc_ms"] is not None and row["p90_ttft_chat_ms"] is not None
    assert set(result["comparison"]["3"]) == {"p90_tbt_ms_ratio", "p90_ttft_ms_ratio", "request_goodput_ratio"}
