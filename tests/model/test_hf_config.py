"""config.json parsing: each family's options become ModelArgs; unsupported architectures and options are
refused by name; hostile configs give ValueError with a message, never another exception."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncaked.model.config import ModelArgs
from mooncaked.model.families import ConfigError, UnsupportedModel, args_from_hf_config
from mooncaked.model.hf_config import to_hf_config
from mooncaked.model.loader import load_model
from mooncaked.model.presets import random_preset
from mooncaked.model.rope_scaling import Llama3Scaling
from tests.model.family_checkpoints import CASES, hf_config

transformers = pytest.importorskip("transformers")


def _saved_config(family: str, **overrides: Any) -> dict[str, Any]:
    """config.json as transformers writes it for the first case of `family`, with overrides."""
    case = next(c for c in CASES if c.model_type == family)
    config: dict[str, Any] = hf_config(case).to_dict()
    config.update(overrides)
    return config


@pytest.mark.parametrize("case", CASES, ids=[c.case_id for c in CASES])
def test_to_hf_config_round_trips(case: Any) -> None:
    args = args_from_hf_config(hf_config(case).to_dict())
    assert args_from_hf_config(to_hf_config(args)) == args
    config = to_hf_config(args)
    rebuilt = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    assert args_from_hf_config(rebuilt.to_dict()) == args


def test_transformers_4_style_config() -> None:
    """Older checkpoints: rope_theta and rope_scaling at top level, Qwen's window off but sized."""
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 320, "hidden_size": 64,
              "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "rope_theta": 1000000.0, "rope_scaling": None, "use_sliding_window": False, "sliding_window": 131072,
              "max_window_layers": 21, "tie_word_embeddings": True, "eos_token_id": 2, "bos_token_id": 1}
    args = args_from_hf_config(config)
    assert args.sliding_window is None and args.qkv_bias and args.rope_theta == 1e6
    llama31 = {**config, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "eos_token_id": [1, 2],
               "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    args = args_from_hf_config(llama31)
    assert args.rope_scaling == Llama3Scaling(8.0, 1.0, 4.0, 8192) and args.eos_token_ids == (1, 2)


@pytest.mark.parametrize("overrides, message", [
    ({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}, "model_type 'mixtral'"),
    ({"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]}, "model_type 'gemma2'"),
    ({"model_type": None}, "model_type None"),
    ({"architectures": ["LlamaForSequenceClassification"]}, "LlamaForSequenceClassification"),
    ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e4}}, "rope_scaling type 'longrope'"),
    ({"rope_scaling": {"type": "proportional", "factor": 2.0}}, "rope_scaling type 'proportional'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "quant_method 'awq'"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
])
def test_unsupported_architectures_and_options_are_named(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(UnsupportedModel, match=message):
        args_from_hf_config(_saved_config("llama", **overrides))


def test_unknown_qwen_layer_type_is_named() -> None:
    config = _saved_config("qwen2", use_sliding_window=True, sliding_window=8,
                           layer_types=["full_attention", "chunked_attention"])
    with pytest.raises(UnsupportedModel, match="chunked_attention"):
        args_from_hf_config(config)


@pytest.mark.parametrize("overrides, message", [
    ({"hidden_size": "64"}, "hidden_size must be an integer"),
    ({"num_attention_heads": 3, "head_dim": None}, "not a multiple of num_attention_heads"),
    ({"num_key_value_heads": 3}, "must be a multiple of num_key_value_heads|multiple of"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a positive finite"),
    ({"eos_token_id": 400}, "special token id 400 is outside the vocabulary"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                          "rope_theta": 1e4}}, "low_freq_factor < high_freq_factor"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     "no 'original_max_position_embeddings'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": -4.0, "original_max_position_embeddings": 64}},
     "rope scaling factor must be a positive finite number"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                          "mscale": "1"}}, "mscale must be a number"),
    ({"rope_scaling": {"type": "linear"}}, "no 'factor'"),
])
def test_bad_values_are_named(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        args_from_hf_config(_saved_config("llama", **overrides))


@pytest.mark.parametrize("overrides, message", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok \\(9\\) exceeds the number of experts \\(8\\)"),
    ({"moe_intermediate_size": 0}, "moe_intermediate_size must be positive"),
    ({"mlp_only_layers": "1"}, "mlp_only_layers must be a list"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step must be positive"),
    ({"num_experts_per_tok": None}, "num_experts_per_tok must be an integer"),
])
def test_bad_moe_values_are_named(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        args_from_hf_config(_saved_config("qwen3_moe", **overrides))


@pytest.mark.parametrize("overrides, error, message", [
    ({"topk_group": 5}, ConfigError, r"topk_group \(5\) exceeds n_group \(4\)"),
    ({"n_group": 3}, ConfigError, r"n_group \(3\) does not divide the 8 experts"),
    ({"kv_lora_rank": 0}, ConfigError, "kv_lora_rank must be positive"),
    ({"qk_rope_head_dim": 7}, ConfigError, "qk_rope_head_dim must be even"),
    ({"q_lora_rank": "32"}, ConfigError, "q_lora_rank must be an integer"),
    ({"scoring_func": "softmax"}, UnsupportedModel, "scoring_func 'softmax' is not supported for deepseek_v3"),
    ({"topk_method": "greedy"}, UnsupportedModel, "topk_method 'greedy'"),
    ({"attention_bias": True}, UnsupportedModel, "attention_bias True"),
    ({"first_k_dense_replace": -1}, ConfigError, "first_k_dense_replace must be >= 0"),
])
def test_bad_deepseek_values_are_named(overrides: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        args_from_hf_config(_saved_config("deepseek_v3", **overrides))


def test_deepseek_shapes_and_kimi_k2() -> None:
    """The tiny case: MLA with a query bottleneck, one dense layer, sigmoid-routed grouped experts; Kimi K2's
    model_type reads as the same family."""
    args = args_from_hf_config(_saved_config("deepseek_v3"))
    assert args.mla is not None and args.mla.q_lora_rank == 32 and args.moe is not None
    assert args.moe.sparse_layers == (1, 2) and args.moe.num_shared_experts == 1 and args.moe.has_correction_bias
    assert args.kv_bytes_per_token(2) == 3 * (32 + 8) * 2  # the latent and the rope key per layer, bf16
    kimi = args_from_hf_config(_saved_config("deepseek_v3", model_type="kimi_k2"))
    assert kimi == args
    plain_q = args_from_hf_config(_saved_config("deepseek_v3", q_lora_rank=None))
    assert plain_q.mla is not None and plain_q.mla.q_lora_rank is None


def test_moe_model_without_sparse_layers_is_refused() -> None:
    with pytest.raises(UnsupportedModel, match="no layer of this qwen3_moe model has experts"):
        args_from_hf_config(_saved_config("qwen3_moe", mlp_only_layers=[0, 1, 2]))


def test_missing_required_key_is_named() -> None:
    config = _saved_config("mistral")
    del config["intermediate_size"]
    with pytest.raises(ConfigError, match="no 'intermediate_size'"):
        args_from_hf_config(config)


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**40, max_value=2**40) | st.floats(allow_nan=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6)


@settings(max_examples=300, deadline=None)
@given(model_type=st.sampled_from(["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3"]), data=st.data())
def test_hostile_configs_raise_value_errors_with_a_message(model_type: str, data: st.DataObject) -> None:
    config = copy.deepcopy(_saved_config(model_type))
    for _ in range(data.draw(st.integers(min_value=1, max_value=3))):
        key = data.draw(st.sampled_from(sorted(config)) | st.sampled_from(["rope_scaling", "head_dim", "layer_types"]))
        if data.draw(st.booleans()):
            config.pop(key, None)
        else:
            config[key] = data.draw(_JSON_VALUES)
    try:
        args = args_from_hf_config(config)
    except ValueError as exc:
        assert str(exc)
        return
    assert isinstance(args, ModelArgs) and args.num_heads % args.num_kv_heads == 0
    assert math.isfinite(args.rope_theta) and args.rms_norm_eps > 0


def test_directory_errors_name_the_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json is not valid JSON"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(_saved_config("llama", hidden_act="relu")))
    with pytest.raises(UnsupportedModel, match=r"config.json: hidden_act 'relu'"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(_saved_config("deepseek_v3", topk_group=5)))
    with pytest.raises(ConfigError, match=r"config.json: model config: topk_group \(5\) exceeds n_group \(4\)"):
        load_model(str(tmp_path))


def test_model_args_family_rules() -> None:
    with pytest.raises(ValueError, match="a mistral model cannot have qkv_bias=True"):
        random_preset("tiny", family="mistral", qkv_bias=True)
    with pytest.raises(ValueError, match="family 'gpt2'"):
        random_preset("tiny", family="gpt2")
    with pytest.raises(ValueError, match="full_attention_layers"):
        random_preset("tiny", family="qwen2", qkv_bias=True, sliding_window=4, full_attention_layers=(5,))
