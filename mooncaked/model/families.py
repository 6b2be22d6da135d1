"""Hugging Face `config.json` -> ModelArgs for the supported families, refusing what they cannot run.

1. `args_from_hf_config(config)` reads the model_type and picks the family: llama (Llama 2/3/3.1/3.2),
   mistral, qwen2 (Qwen2/2.5), qwen3 (dense), qwen3_moe (Qwen3-MoE). An architecture or option outside what the
   model definition runs (another model_type, quantization but block FP8 (model.fp8_blocks), rope types other
   than llama3, yarn, linear and dynamic, activations other than SiLU, partial rotary) raises UnsupportedModel
   naming it.
2. Every field is type-checked on the way (ConfigError names the key), so a hostile config.json gives a
   ValueError with a message, never a KeyError or TypeError.
3. Each family's small differences (biases, q/k norm, sliding window layers, the experts and their router)
   become ModelArgs fields.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from mooncaked.model.config import ModelArgs
from mooncaked.model.config_fields import (ConfigError, UnsupportedModel, bool_field, float_field, int_field,
                                           optional_float_field, optional_int_field, token_ids_field)
from mooncaked.model.deepseek import deepseek_options
from mooncaked.model.fp8_blocks import Fp8FormatError, fp8_format
from mooncaked.model.moe_args import MoEArgs
from mooncaked.model.rope_scaling import DynamicScaling, Llama3Scaling, LinearScaling, RopeScaling, YarnScaling

# model_type -> the transformers class whose checkpoints we load
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM", "kimi_k2": "DeepseekV3ForCausalLM"}
_FAMILY_OF = {"kimi_k2": "deepseek_v3"}  # model_types whose checkpoints are another family's
_SUPPORTED = ", ".join(f"{t} ({a})" for t, a in ARCHITECTURES.items())


def args_from_hf_config(config: Mapping[str, Any]) -> ModelArgs:
    """ModelArgs of a Hugging Face config.json dict; raises ConfigError or UnsupportedModel."""
    if not isinstance(config, Mapping):
        raise ConfigError(f"config.json must hold a JSON object, got {type(config).__name__}")
    model_type = config.get("model_type")
    architectures = config.get("architectures")
    if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
        raise UnsupportedModel(f"model_type {model_type!r} (architectures {architectures}) is not supported; "
                               f"supported: {_SUPPORTED}")
    expected = ARCHITECTURES[model_type]
    if architectures is not None and architectures != [expected]:
        raise UnsupportedModel(f"architectures {architectures!r} is not supported for model_type {model_type!r}; "
                               f"only [{expected!r}]")
    _refuse_unsupported_options(config)
    try:
        return _build(model_type, config)
    except (ConfigError, UnsupportedModel):
        raise
    except ValueError as exc:  # ModelArgs / MoEArgs / rope scaling validation
        raise ConfigError(str(exc)) from exc


def _refuse_unsupported_options(config: Mapping[str, Any]) -> None:
    if config.get("quantization_config") is not None:
        quant = config["quantization_config"]
        method = quant.get("quant_method") if isinstance(quant, Mapping) else quant
        if method != "fp8" or not isinstance(quant, Mapping):
            raise UnsupportedModel(f"quantization_config (quant_method {method!r}) is not supported; serve an "
                                   "unquantized (bf16/fp16/fp32) or FP8 block-quantized checkpoint, or a GGUF file")
        try:
            fp8_format(quant)
        except Fp8FormatError as exc:
            raise UnsupportedModel(str(exc)) from exc
    activation = config.get("hidden_act", "silu")
    if activation != "silu":
        raise UnsupportedModel(f"hidden_act {activation!r} is not supported; only 'silu'")
    rotary = config.get("partial_rotary_factor", 1.0)
    if rotary != 1.0:
        raise UnsupportedModel(f"partial_rotary_factor {rotary!r} is not supported; only 1.0 (full rotary)")


def _build(model_type: str, config: Mapping[str, Any]) -> ModelArgs:
    family = _FAMILY_OF.get(model_type, model_type)
    num_heads = int_field(config, "num_attention_heads")
    hidden_size = int_field(config, "hidden_size")
    head_dim = optional_int_field(config, "head_dim")
    if family == "deepseek_v3":
        head_dim = 0  # its heads' widths are MLA's (deepseek_options)
    elif head_dim is None:
        if num_heads <= 0 or hidden_size % num_heads != 0:
            raise ConfigError(f"config.json: hidden_size ({hidden_size}) is not a multiple of num_attention_heads "
                              f"({num_heads}) and no head_dim is given")
        head_dim = hidden_size // num_heads
    num_layers = int_field(config, "num_hidden_layers")
    num_kv_heads = optional_int_field(config, "num_key_value_heads")
    rope = _rope_parameters(config)
    max_positions = int_field(config, "max_position_embeddings", 2048)
    fields: dict[str, Any] = {
        "vocab_size": int_field(config, "vocab_size"), "hidden_size": hidden_size,
        "intermediate_size": int_field(config, "intermediate_size"), "num_layers": num_layers, "num_heads": num_heads,
        "num_kv_heads": num_heads if num_kv_heads is None else num_kv_heads,  # null: multi-head attention
        "head_dim": head_dim, "rms_norm_eps": float_field(config, "rms_norm_eps", 1e-6),
        "rope_theta": _rope_theta(config, rope), "rope_scaling": _rope_scaling(rope, max_positions),
        "max_position_embeddings": max_positions, "tie_word_embeddings": bool_field(config, "tie_word_embeddings", False),
        "bos_token_id": optional_int_field(config, "bos_token_id"), "eos_token_ids": token_ids_field(config, "eos_token_id"),
        "family": family}
    return ModelArgs(**(fields | _FAMILY_OPTIONS[family](config, num_layers)))


def _llama_options(config: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    attention_bias = bool_field(config, "attention_bias", False)
    return {"qkv_bias": attention_bias, "o_bias": attention_bias, "mlp_bias": bool_field(config, "mlp_bias", False)}


def _mistral_options(config: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    # transformers' Mistral applies sliding_window to every layer (it ignores layer_types)
    return {"sliding_window": optional_int_field(config, "sliding_window")}


def _qwen2_options(config: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    return {"qkv_bias": True, **_qwen_window(config, num_layers)}


def _qwen3_options(config: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    attention_bias = bool_field(config, "attention_bias", False)
    return {"qkv_bias": attention_bias, "o_bias": attention_bias, "qk_norm": True,
            **_qwen_window(config, num_layers)}


def _qwen3_moe_options(config: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """Qwen3's attention; layer i's MLP is sparse unless in mlp_only_layers, when (i + 1) % decoder_sparse_step
    is 0 (transformers' rule); routing is softmax top-k, renormalized with norm_topk_prob."""
    num_experts = int_field(config, "num_experts") if "num_experts" in config else int_field(config, "num_local_experts")
    mlp_only = config.get("mlp_only_layers", [])
    if not isinstance(mlp_only, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in mlp_only):
        raise ConfigError(f"config.json: mlp_only_layers must be a list of layer indices, got {mlp_only!r}")
    step = int_field(config, "decoder_sparse_step", 1)
    if step <= 0:
        raise ConfigError(f"config.json: decoder_sparse_step must be positive, got {step}")
    sparse = tuple(i for i in range(num_layers) if i not in mlp_only and num_experts > 0 and (i + 1) % step == 0)
    if not sparse:
        raise UnsupportedModel("config.json: no layer of this qwen3_moe model has experts (num_experts, "
                               "decoder_sparse_step, mlp_only_layers); serve it as a dense qwen3 checkpoint")
    moe = MoEArgs(num_experts=num_experts, num_experts_per_token=int_field(config, "num_experts_per_tok"),
                  intermediate_size=int_field(config, "moe_intermediate_size"), sparse_layers=sparse,
                  norm_topk_prob=bool_field(config, "norm_topk_prob", False))
    return {**_qwen3_options(config, num_layers), "moe": moe}


def _qwen_window(config: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """Qwen: a window only with use_sliding_window, on the layers layer_types (or max_window_layers) marks."""
    if not bool_field(config, "use_sliding_window", False):
        return {}
    window = optional_int_field(config, "sliding_window")
    if window is None:
        raise ConfigError("config.json: use_sliding_window is set but sliding_window is null")
    layer_types = config.get("layer_types")
    if layer_types is None:
        first_windowed = int_field(config, "max_window_layers", 28)
        layer_types = ["sliding_attention" if i >= first_windowed else "full_attention" for i in range(num_layers)]
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise ConfigError(f"config.json: layer_types must list one entry per layer ({num_layers})")
    unknown = sorted({str(t) for t in layer_types} - {"full_attention", "sliding_attention"})
    if unknown:
        raise UnsupportedModel(f"layer_types {unknown} are not supported; only full_attention, sliding_attention")
    full = tuple(i for i, t in enumerate(layer_types) if t == "full_attention")
    if len(full) == num_layers:
        return {}
    return {"sliding_window": window, "full_attention_layers": full}


_FAMILY_OPTIONS: dict[str, Callable[[Mapping[str, Any], int], dict[str, Any]]] = {
    "llama": _llama_options, "mistral": _mistral_options, "qwen2": _qwen2_options, "qwen3": _qwen3_options,
    "qwen3_moe": _qwen3_moe_options, "deepseek_v3": deepseek_options,
}


def _rope_parameters(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """`rope_scaling` (transformers 4) or `rope_parameters` (transformers 5); {} when neither is set."""
    for key in ("rope_scaling", "rope_parameters"):
        value = config.get(key)
        if value is not None:
            if not isinstance(value, Mapping):
                raise ConfigError(f"config.json: {key} must be an object, got {value!r}")
            return value
    return {}


def _rope_theta(config: Mapping[str, Any], rope: Mapping[str, Any]) -> float:
    if "rope_theta" in config:
        return float_field(config, "rope_theta")
    return float_field(rope, "rope_theta", 10000.0)


ROPE_TYPES = ("default", "llama3", "yarn", "linear", "dynamic")


def _rope_scaling(rope: Mapping[str, Any], max_positions: int) -> RopeScaling | None:
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModel(f"rope_scaling type {rope_type!r} is not supported; only {', '.join(ROPE_TYPES)}")
    if rope_type == "default":
        return None
    if rope_type == "llama3":
        return Llama3Scaling(factor=float_field(rope, "factor"), low_freq_factor=float_field(rope, "low_freq_factor", 1.0),
                             high_freq_factor=float_field(rope, "high_freq_factor", 4.0),
                             original_max_position_embeddings=int_field(rope, "original_max_position_embeddings", 8192))
    if rope_type == "yarn":
        return _yarn(rope, max_positions)
    if rope_type == "linear":
        return LinearScaling(float_field(rope, "factor"))
    return DynamicScaling(float_field(rope, "factor"))


def _yarn(rope: Mapping[str, Any], max_positions: int) -> YarnScaling:
    """transformers' defaults: beta_fast 32, beta_slow 1 (also for null or 0), truncate true; factor null:
    max_position_embeddings / original_max_position_embeddings (DeepSeek-V3's reading)."""
    original = int_field(rope, "original_max_position_embeddings")
    factor = max_positions / original if rope.get("factor") is None else float_field(rope, "factor")
    optional = {name: optional_float_field(rope, name) for name in ("mscale", "mscale_all_dim", "attention_factor")}
    return YarnScaling(factor=factor, original_max_position_embeddings=original,
                       beta_fast=optional_float_field(rope, "beta_fast") or 32.0,
                       beta_slow=optional_float_field(rope, "beta_slow") or 1.0, truncate=bool_field(rope, "truncate", True),
                       **optional)
