"""A model's shape as the simulator's cost model takes it (`mooncaked sim --model-config`).

The simulator is pure policy and cannot read a checkpoint's config itself; the CLI turns the model's `ModelArgs`
into `model.*` settings of the simulator's config (sim/config.py ModelConfig):
1. `kv_bytes_per_token`: the cache's real width (an MLA model's latent and rope key, GQA's K and V heads).
2. `active_parameters`: the weights one token's forward multiplies by (an MoE model's routed experts it uses,
   not all of them): prefill FLOPs per new token are twice that.
3. `attention_width`: query heads x (query-key width + value width) / 2, the width Eq. 1's quadratic term takes
   (the hidden size for a LLaMA-shaped model; an MLA model's heads are wider).
4. `weight_bytes`: every weight once (a decode step of a large batch reads nearly every expert).
"""

from __future__ import annotations

from mooncaked.model.config import ModelArgs
from mooncaked.model.weight_names import num_active_parameters, num_parameters


def sim_model_settings(args: ModelArgs, dtype_bytes: int) -> dict[str, int | float]:
    """The simulator's `model.*` settings for `args` with weights and KV of `dtype_bytes` each."""
    if dtype_bytes <= 0:
        raise ValueError(f"dtype_bytes must be positive, got {dtype_bytes}")
    if args.mla is not None:
        qk_width, v_width = args.mla.qk_nope_head_dim + args.mla.qk_rope_head_dim, args.mla.v_head_dim
    else:
        qk_width = v_width = args.head_dim
    return {
        "num_layers": args.num_layers,
        "hidden_size": args.hidden_size,
        "dtype_bytes": dtype_bytes,
        "kv_bytes_per_token": args.kv_bytes_per_token(dtype_bytes),
        "active_parameters": float(num_active_parameters(args)),
        "attention_width": args.num_heads * (qk_width + v_width) // 2,
        "weight_bytes": float(num_parameters(args) * dtype_bytes),
    }
