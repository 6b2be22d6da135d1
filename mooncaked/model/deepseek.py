"""The `deepseek_v3` family's config.json (DeepSeek-V3/R1, and Kimi K2's `kimi_k2` text configs) -> ModelArgs fields.

1. `deepseek_options(config, num_layers)` reads Multi-head Latent Attention (q_lora_rank or a plain q_proj,
   kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, rope_interleave) and the experts (sigmoid
   scores with e_score_correction_bias, n_group / topk_group, norm_topk_prob, routed_scaling_factor, shared
   experts; the first first_k_dense_replace layers dense) into MLAArgs and MoEArgs; the caller (model.families)
   adds the fields every family shares.
2. What the original DeepSeek configs may name that this runs otherwise (scoring_func other than sigmoid,
   topk_method other than noaux_tc, moe_layer_freq other than 1, attention biases) is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mooncaked.model.config_fields import ConfigError, UnsupportedModel, bool_field, float_field, int_field
from mooncaked.model.mla_args import MLAArgs
from mooncaked.model.moe_args import MoEArgs

# fields of the original DeepSeek-V3 config.json and the only values the model here runs
_FIXED = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1, "attention_bias": False}


def deepseek_options(config: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    for key, value in _FIXED.items():
        if key in config and config[key] != value:
            raise UnsupportedModel(f"config.json: {key} {config[key]!r} is not supported for deepseek_v3; only "
                                   f"{value!r}")
    q_lora_rank = config.get("q_lora_rank")
    mla = MLAArgs(kv_lora_rank=int_field(config, "kv_lora_rank"),
                  qk_nope_head_dim=int_field(config, "qk_nope_head_dim"),
                  qk_rope_head_dim=int_field(config, "qk_rope_head_dim"), v_head_dim=int_field(config, "v_head_dim"),
                  q_lora_rank=None if q_lora_rank is None else int_field(config, "q_lora_rank"),
                  is_rope_interleaved=bool_field(config, "rope_interleave", True))
    num_mtp_layers = int_field(config, "num_nextn_predict_layers", 0)
    if num_mtp_layers < 0:
        raise ConfigError(f"config.json: num_nextn_predict_layers must be >= 0, got {num_mtp_layers}")
    return {"num_kv_heads": 1, "head_dim": mla.qk_head_dim, "mla": mla, "moe": _experts(config, num_layers),
            "num_mtp_layers": num_mtp_layers}


def _experts(config: Mapping[str, Any], num_layers: int) -> MoEArgs | None:
    num_experts = int_field(config, "n_routed_experts", 0)
    first_sparse = int_field(config, "first_k_dense_replace", 0)
    if num_experts == 0 or first_sparse >= num_layers:
        return None
    if first_sparse < 0:
        raise ConfigError(f"config.json: first_k_dense_replace must be >= 0, got {first_sparse}")
    return MoEArgs(num_experts=num_experts, num_experts_per_token=int_field(config, "num_experts_per_tok"),
                   intermediate_size=int_field(config, "moe_intermediate_size"),
                   sparse_layers=tuple(range(first_sparse, num_layers)), scoring="sigmoid",
                   norm_topk_prob=bool_field(config, "norm_topk_prob", True),
                   num_groups=int_field(config, "n_group", 1), num_groups_per_token=int_field(config, "topk_group", 1),
                   routed_scaling_factor=float_field(config, "routed_scaling_factor", 1.0), has_correction_bias=True,
                   num_shared_experts=int_field(config, "n_shared_experts", 0))
