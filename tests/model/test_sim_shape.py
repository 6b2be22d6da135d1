"""A model's shape for the simulator (model/sim_shape.py, `mooncaked sim --model-config`): the KV width, active
parameters and attention width of the model's own config, so the simulator moves an MLA prefix as few bytes as the
daemon does and costs an MoE prefill by the experts it uses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mooncaked import cli
from mooncaked.model.families import args_from_hf_config
from mooncaked.model.sim_shape import sim_model_settings
from mooncaked.model.weight_names import num_active_parameters, num_parameters
from mooncaked.sim.config import SimConfig, with_overrides
from mooncaked.sim.costs import build_cost_model
from tests.model.test_hf_config import _saved_config


def _costs(settings: dict[str, int | float]) -> tuple[float, float]:
    """(seconds to move one block, seconds to prefill 4096 new tokens) in the simulator's cost model."""
    costs = build_cost_model(with_overrides(SimConfig(), "model", **settings))
    return costs.predictors.transfer.predict(1), costs.predictors.prefill.predict(4096, 0)


def test_an_mla_model_moves_its_latent_and_an_moe_model_computes_with_its_active_experts() -> None:
    mla = args_from_hf_config(_saved_config("deepseek_v3"))
    gqa = args_from_hf_config(_saved_config("llama"))
    mla_settings, gqa_settings = sim_model_settings(mla, 2), sim_model_settings(gqa, 2)
    assert mla_settings["kv_bytes_per_token"] == mla.kv_bytes_per_token(2) == 3 * (32 + 8) * 2
    assert gqa_settings["kv_bytes_per_token"] == gqa.kv_bytes_per_token(2)
    assert mla_settings["active_parameters"] == num_active_parameters(mla) < num_parameters(mla)
    assert mla_settings["weight_bytes"] == 2 * num_parameters(mla)
    assert gqa_settings["attention_width"] == gqa.num_heads * gqa.head_dim
    (mla_block_s, mla_prefill_s), (gqa_block_s, _) = _costs(mla_settings), _costs(gqa_settings)
    latency_s = SimConfig().cluster.link_latency_s
    ratio = (gqa_block_s - latency_s) / (mla_block_s - latency_s)
    assert ratio == pytest.approx(gqa.kv_bytes_per_token(2) / mla.kv_bytes_per_token(2))
    dense_mla = dict(mla_settings, active_parameters=float(num_parameters(mla)))
    assert _costs(dense_mla)[1] > mla_prefill_s  # every expert would cost more than the routed ones


def test_deepseek_v3s_real_shape_moves_a_prefix_several_times_faster_than_llama3_70bs() -> None:
    """DeepSeek-V3's published dimensions: 61 layers x (512 + 64) latent values, ~70 KB per token in bf16,
    against LLaMA3-70B's 320 KiB (the simulator's default model)."""
    config = _saved_config("deepseek_v3", num_hidden_layers=61, hidden_size=7168, num_attention_heads=128,
                           num_key_value_heads=128, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                           v_head_dim=128, q_lora_rank=1536)
    settings = sim_model_settings(args_from_hf_config(config), 2)
    assert settings["kv_bytes_per_token"] == 61 * 576 * 2
    default_costs, mla_costs = build_cost_model(SimConfig()), build_cost_model(
        with_overrides(SimConfig(), "model", **settings))
    assert default_costs.kv_bytes_per_token / mla_costs.kv_bytes_per_token == pytest.approx(327680 / 70272)


def test_the_cli_reads_a_model_config_into_the_simulators_model_section(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_saved_config("deepseek_v3")))
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i * 1000, "input_length": 1000, "output_length": 4,
                                         "hash_ids": [i, i + 1]}) + "\n" for i in range(4)))
    out = tmp_path / "sim.json"
    assert cli.main(["sim", "--trace", str(trace), "--model-config", str(tmp_path), "--no-progress",
                     "--set", "cluster.num_prefill=1", "--set", "cluster.num_decode=1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["summary"]["num_requests"] == 4
    assert result["config"]["model"]["kv_bytes_per_token"] == 3 * (32 + 8) * 2  # the tiny MLA's latent
    assert cli.main(["sim", "--trace", str(trace), "--model-config", str(tmp_path / "missing")]) == 2
    assert "--model-config" in capsys.readouterr().err
