"""A short run of `mooncaked bench batch` with the tiny model: the cluster starts as a `--role all` process tree,
serves interactive load alone and beside a batch, the batch completes within the run, the JSON is complete."""

from __future__ import annotations

import json
from pathlib import Path

from mooncaked.cli import main


def test_batch_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "batch.json"
    assert main(["bench", "batch", "--model", "random:tiny", "--vocab-size", "320", "--rate", "3",
                 "--duration-s", "2", "--tail-s", "15", "--chat-tokens", "20", "--output-tokens", "6",
                 "--batch-lines", "12", "--batch-prefix-tokens", "16", "--batch-prompt-tokens", "8",
                 "--batch-output-tokens", "4", "--no-progress", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["clean_exit"] and len(result["repeats"]) == 1
    [pair] = result["repeats"]
    assert pair["alone"]["completed"] >= 3 and pair["with_batch"]["completed"] == pair["alone"]["completed"]
    assert pair["alone"]["failed"] == pair["with_batch"]["failed"] == 0
    assert pair["batch"]["status"] == "completed" and pair["batch"]["finished_within_run"]
    assert pair["batch"]["request_counts"] == {"total": 12, "completed": 12, "failed": 0}
    assert pair["interactive_ttft_p90_ratio"] > 0 and pair["interactive_tbt_p90_ratio"] > 0
    assert result["summary"]["batches_finished_within_run"] == 1
