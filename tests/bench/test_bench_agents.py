"""A short run of `mooncaked bench agents` with the tiny random model: the cluster starts as a `--role all` process
tree, the JSON, tool, throughput and TTFT parts run through the openai client, and the JSON has every key."""

from __future__ import annotations

import json
from pathlib import Path

from mooncaked.bench.agents import draw_schemas, long_array_schema
from mooncaked.cli import main


def test_agents_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "agents.json"
    assert main(["bench", "agents", "--model", "random:tiny", "--num-json", "4", "--num-tools", "2",
                 "--concurrency", "2", "--rounds", "1", "--ttft-rounds", "1", "--throughput-tokens", "16",
                 "--max-tokens", "200", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["clean_exit"] and result["model"] == "bench-model"
    assert 0.0 <= result["valid_share"] <= 1.0 and 0.0 <= result["tool_valid_share"] <= 1.0
    assert sum(result["json_finish_reasons"].values()) == 4 and sum(result["tool_finish_reasons"].values()) == 2
    assert result["tool_finish_reasons"].get("tool_calls", 0) + result["tool_finish_reasons"].get("length", 0) == 2
    assert result["constrained_tok_s_ratio"] > 0 and len(result["tok_s_constrained"]) == 1
    assert result["ttft_new_schema_ms"] > 0 and result["ttft_cached_schema_ms"] > 0


def test_schemas_are_drawn_alike_for_a_seed_and_answers_are_longer_than_the_tokens() -> None:
    first, again = draw_schemas(6, seed=3), draw_schemas(6, seed=3)
    assert first == again and len(first) == 6 and all(s["type"] == "object" for s in first)
    assert long_array_schema(32)["json_schema"]["schema"]["properties"]["items"]["minItems"] == 32
