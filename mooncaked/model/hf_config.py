"""ModelArgs -> the equivalent Hugging Face `config.json` dict (tests and benchmarks build transformers' model of
the same shape with it; model.families reads it back into equal ModelArgs).

1. `to_hf_config(args)`: the family's transformers fields, its RoPE scaling, its experts (Qwen3-MoE's
   mlp_only_layers, DeepSeek-V3's first_k_dense_replace and router) and its latent attention (DeepSeek-V3).
"""

from __future__ import annotations

from typing import Any

from mooncaked.model.config import ModelArgs
from mooncaked.model.families import ARCHITECTURES
from mooncaked.model.moe_args import MoEArgs
from mooncaked.model.rope_scaling import DynamicScaling, Llama3Scaling, LinearScaling, RopeScaling, YarnScaling


def to_hf_config(args: ModelArgs) -> dict[str, Any]:
    """The equivalent `config.json` dict of `args`' family."""
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[args.family]], "model_type": args.family,
        "vocab_size": args.vocab_size, "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size, "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads, "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.head_dim, "rms_norm_eps": args.rms_norm_eps, "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_position_embeddings,
        "tie_word_embeddings": args.tie_word_embeddings, "hidden_act": "silu",
        "bos_token_id": args.bos_token_id,
        "eos_token_id": list(args.eos_token_ids) if len(args.eos_token_ids) != 1 else args.eos_token_ids[0],
    }
    config.update(_family_options(args))
    if args.rope_scaling is not None:
        config["rope_scaling"] = _rope_scaling(args.rope_scaling)
    return config


def _family_options(args: ModelArgs) -> dict[str, Any]:
    if args.family == "deepseek_v3":
        return _deepseek_options(args)
    if args.family == "llama":
        return {"attention_bias": args.qkv_bias, "mlp_bias": args.mlp_bias}
    if args.family == "mistral":
        return {"sliding_window": args.sliding_window}
    layer_types = ["full_attention" if args.layer_sliding_window(i) is None else "sliding_attention"
                   for i in range(args.num_layers)]
    options: dict[str, Any] = {"use_sliding_window": args.sliding_window is not None,
                               "sliding_window": args.sliding_window, "layer_types": layer_types}
    if args.family in ("qwen3", "qwen3_moe"):
        options["attention_bias"] = args.qkv_bias
    if args.moe is not None:
        options.update(_moe_options(args.moe, args.num_layers))
    return options


def _deepseek_options(args: ModelArgs) -> dict[str, Any]:
    assert args.mla is not None
    mla, moe = args.mla, args.moe
    options: dict[str, Any] = {
        "q_lora_rank": mla.q_lora_rank, "kv_lora_rank": mla.kv_lora_rank, "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim, "v_head_dim": mla.v_head_dim,
        "rope_interleave": mla.is_rope_interleaved, "num_key_value_heads": args.num_heads,
        "num_nextn_predict_layers": args.num_mtp_layers, "attention_bias": False,
        "first_k_dense_replace": args.num_layers if moe is None else min(moe.sparse_layers)}
    if moe is not None:
        options.update({"n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.num_experts_per_token,
                        "moe_intermediate_size": moe.intermediate_size, "n_group": moe.num_groups,
                        "topk_group": moe.num_groups_per_token, "norm_topk_prob": moe.norm_topk_prob,
                        "routed_scaling_factor": moe.routed_scaling_factor,
                        "n_shared_experts": moe.num_shared_experts})
    return options


def _rope_scaling(s: RopeScaling) -> dict[str, Any]:
    if isinstance(s, Llama3Scaling):
        return {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings}
    if isinstance(s, YarnScaling):
        optional = {"mscale": s.mscale, "mscale_all_dim": s.mscale_all_dim, "attention_factor": s.attention_factor}
        return {"rope_type": "yarn", "factor": s.factor,
                "original_max_position_embeddings": s.original_max_position_embeddings, "beta_fast": s.beta_fast,
                "beta_slow": s.beta_slow, "truncate": s.truncate,
                **{key: value for key, value in optional.items() if value is not None}}
    rope_type = "linear" if isinstance(s, LinearScaling) else "dynamic"
    assert isinstance(s, (LinearScaling, DynamicScaling))
    return {"rope_type": rope_type, "factor": s.factor}


def _moe_options(moe: MoEArgs, num_layers: int) -> dict[str, Any]:
    """Qwen3-MoE's fields for `moe` (sparse layers given as mlp_only_layers, the complement)."""
    return {"num_experts": moe.num_experts, "num_experts_per_tok": moe.num_experts_per_token,
            "moe_intermediate_size": moe.intermediate_size, "norm_topk_prob": moe.norm_topk_prob,
            "decoder_sparse_step": 1, "mlp_only_layers": [i for i in range(num_layers) if not moe.is_sparse(i)]}
