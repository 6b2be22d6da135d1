"""The tensors a checkpoint of a model holds: Hugging Face names and shapes, derived from ModelArgs alone.

1. `hf_tensor_shapes(args)`: every tensor the model needs, name -> shape in Hugging Face layout ([out, in]
   for projections). The count of parameters, the random test weights and checkpoint validation all read it.
2. `is_ignored(name, args)`: tensors checkpoints may carry that the model does not use (precomputed RoPE
   buffers, the duplicate lm_head of a model with tied embeddings).
3. `check_tensor` / `check_complete`: a checkpoint's tensor list against the expected one, before any weight
   memory is allocated (safetensors headers) and again while copying; errors name the tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from mooncaked.model.config import LayerRange, ModelArgs
from mooncaked.model.mla_args import MLAArgs
from mooncaked.model.moe_args import MoEArgs
from mooncaked.runtime.errors import StartupError


class CheckpointError(StartupError, ValueError):
    """A checkpoint's tensors do not match its config (missing, unexpected or mis-shaped); the message names one."""


def hf_tensor_shapes(args: ModelArgs, layers: LayerRange | None = None) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model, or of the stage holding `layers` (a last stage of a model with tied embeddings
    needs the embedding too: it is its output head)."""
    layers = layers or LayerRange.whole(args)
    h, inter = args.hidden_size, args.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {}
    if layers.has_embedding or (layers.has_head and args.tie_word_embeddings):
        shapes["model.embed_tokens.weight"] = (args.vocab_size, h)
    if layers.has_head:
        shapes["model.norm.weight"] = (h,)
        if not args.tie_word_embeddings:
            shapes["lm_head.weight"] = (args.vocab_size, h)
    for i in range(layers.start, layers.end):
        shapes.update(_layer_shapes(args, i, h, inter))
    return shapes


def _layer_shapes(args: ModelArgs, layer_idx: int, h: int, inter: int) -> dict[str, tuple[int, ...]]:
    p = f"model.layers.{layer_idx}."
    # The order of the first nine is the draw order of random_hf_state_dict (seeded presets stay the same).
    shapes: dict[str, tuple[int, ...]] = {p + "input_layernorm.weight": (h,)}
    if args.mla is not None:
        shapes.update(_mla_shapes(args, args.mla, p))
    else:
        a = p + "self_attn."
        shapes.update({a + "q_proj.weight": (args.q_size, h), a + "k_proj.weight": (args.kv_size, h),
                       a + "v_proj.weight": (args.kv_size, h), a + "o_proj.weight": (h, args.q_size)})
    shapes[p + "post_attention_layernorm.weight"] = (h,)
    if args.moe is not None and args.moe.is_sparse(layer_idx):
        shapes.update(_moe_shapes(args.moe, p, h))
    else:
        shapes.update({p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter)})
    if args.qkv_bias:
        shapes.update({p + "self_attn.q_proj.bias": (args.q_size,), p + "self_attn.k_proj.bias": (args.kv_size,),
                       p + "self_attn.v_proj.bias": (args.kv_size,)})
    if args.o_bias:
        shapes[p + "self_attn.o_proj.bias"] = (h,)
    if args.qk_norm:
        shapes.update({p + "self_attn.q_norm.weight": (args.head_dim,),
                       p + "self_attn.k_norm.weight": (args.head_dim,)})
    if args.mlp_bias:
        shapes.update({p + "mlp.gate_proj.bias": (inter,), p + "mlp.up_proj.bias": (inter,),
                       p + "mlp.down_proj.bias": (h,)})
    return shapes


def _mla_shapes(args: ModelArgs, mla: MLAArgs, p: str) -> dict[str, tuple[int, ...]]:
    """Multi-head Latent Attention's projections (DeepSeek-V3 names)."""
    h, q = args.hidden_size, args.num_heads * mla.qk_head_dim
    a = p + "self_attn."
    if mla.q_lora_rank is None:
        shapes: dict[str, tuple[int, ...]] = {a + "q_proj.weight": (q, h)}
    else:
        shapes = {a + "q_a_proj.weight": (mla.q_lora_rank, h), a + "q_a_layernorm.weight": (mla.q_lora_rank,),
                  a + "q_b_proj.weight": (q, mla.q_lora_rank)}
    return shapes | {
        a + "kv_a_proj_with_mqa.weight": (mla.latent_dim, h), a + "kv_a_layernorm.weight": (mla.kv_lora_rank,),
        a + "kv_b_proj.weight": (args.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank),
        a + "o_proj.weight": (h, args.num_heads * mla.v_head_dim)}


def _moe_shapes(moe: MoEArgs, p: str, h: int) -> dict[str, tuple[int, ...]]:
    """A sparse layer's router, routed experts (one gate/up/down each) and shared experts."""
    inter = moe.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {p + "mlp.gate.weight": (moe.num_experts, h)}
    if moe.has_correction_bias:
        shapes[p + "mlp.gate.e_score_correction_bias"] = (moe.num_experts,)
    for e in range(moe.num_experts):
        q = f"{p}mlp.experts.{e}."
        shapes.update({q + "gate_proj.weight": (inter, h), q + "up_proj.weight": (inter, h),
                       q + "down_proj.weight": (h, inter)})
    if moe.num_shared_experts:
        shared = moe.shared_intermediate_size
        q = p + "mlp.shared_experts."
        shapes.update({q + "gate_proj.weight": (shared, h), q + "up_proj.weight": (shared, h),
                       q + "down_proj.weight": (h, shared)})
    return shapes


def num_active_parameters(args: ModelArgs) -> int:
    """Weights one token's forward reads: num_parameters less the routed experts it does not use (the embedding
    counted as for num_parameters)."""
    total = num_parameters(args)
    if args.moe is None:
        return total
    per_expert = 3 * args.moe.intermediate_size * args.hidden_size
    unused = args.moe.num_experts - args.moe.num_experts_per_token
    return total - len(args.moe.sparse_layers) * unused * per_expert


def is_ignored(name: str, args: ModelArgs) -> bool:
    """A tensor the model may find in a checkpoint and does not need (a DeepSeek checkpoint's multi-token
    prediction layers, after the model's)."""
    if name.endswith("rotary_emb.inv_freq") or (args.tie_word_embeddings and name == "lm_head.weight"):
        return True
    if args.num_mtp_layers and name.startswith("model.layers."):
        index = name.split(".")[2]
        return index.isdigit() and args.num_layers <= int(index) < args.num_layers + args.num_mtp_layers
    return False


def check_tensor(name: str, shape: tuple[int, ...], expected: Mapping[str, tuple[int, ...]], source: str) -> None:
    """Raise CheckpointError unless `name` is expected with exactly `shape` (call is_ignored first)."""
    if name not in expected:
        raise CheckpointError(f"{source}: tensor {name!r} is not part of this model (a different architecture "
                              "or a config.json that does not match the weights)")
    if tuple(shape) != expected[name]:
        raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(shape)}, config.json implies "
                              f"{expected[name]}")


def check_complete(seen: Iterable[str], expected: Mapping[str, tuple[int, ...]], source: str) -> None:
    missing = sorted(set(expected) - set(seen))
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5])
        raise CheckpointError(f"{source}: checkpoint is missing {len(missing)} tensor(s): {shown}"
                              + (", ..." if len(missing) > 5 else ""))


def num_parameters(args: ModelArgs) -> int:
    """Weights of a model with `args`, as a checkpoint stores them (an untied output head included)."""
    total = 0
    for shape in hf_tensor_shapes(args).values():
        count = 1
        for dim in shape:
            count *= dim
        total += count
    return total


def random_hf_state_dict(args: ModelArgs, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random fp32 weights with Hugging Face names (std 0.02 like transformers' init; norms near 1)."""
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, shape in hf_tensor_shapes(args).items():
        if name.endswith("norm.weight"):
            state[name] = 1.0 + 0.1 * torch.randn(*shape, generator=gen)
        else:
            state[name] = torch.randn(*shape, generator=gen) * 0.02
    return state
