"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi K2) in the absorbed form, over a cache of latents only.

1. `LatentAttention(args, shape, dtype, device)` allocates the query path (q_a_proj, q_a_layernorm, q_b_proj; or
   a plain q_proj), kv_a_proj_with_mqa (-> the latent and the shared rope key), kv_a_layernorm, and kv_b_proj as
   [heads, qk_nope_head_dim + v_head_dim, kv_lora_rank]: per head W_UK (its key rows) and W_UV (its value rows).
   A tensor-parallel shard holds its query heads' rows of q_b_proj / q_proj and kv_b_proj (o_proj's columns are
   the decoder layer's); q_a_proj, kv_a_proj_with_mqa and the norms are replicated, and so is the latent cache,
   which every head reads (one replicated "KV head", ModelArgs.num_kv_heads == 1).
2. `forward(x, cos, sin, attend, layer_idx)`: per token the cache entry is [normed latent | roped key]
   (kv_lora_rank + qk_rope_head_dim values, one per layer: never expanded per head). The query is absorbed:
   q_nope @ W_UK lands in latent space, so [q_latent | q_rope] . [latent | k_rope] is the score transformers
   computes over expanded keys; attention's output over the same entries as values, restricted to the latent
   columns, times W_UV is the value part. So `attend` is ordinary attention with one KV head of the entry's width
   whose keys and values are the same pages (engine.kv_pages' single plane), in prefill and decode alike.
3. RoPE with `rope_interleave`: the rotated columns come in adjacent pairs; de-interleaving them into halves and
   rotating them as usual is transformers' apply_rotary_pos_emb_interleave (queries and keys alike, so the dot
   products are the same).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mooncaked.model.config import ModelArgs, ShardShape
from mooncaked.model.layers import Linear, RMSNorm
from mooncaked.model.rope import apply_rope
from mooncaked.model.weight_targets import WeightTarget, plain

# attend(layer_idx, q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]) -> attention output [T, H, D]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
_LATENT_NORM_EPS = 1e-6  # DeepSeek's q_a_layernorm and kv_a_layernorm keep RMSNorm's default, not rms_norm_eps


class LatentAttention(nn.Module):
    def __init__(self, args: ModelArgs, shape: ShardShape, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        assert args.mla is not None
        mla = self.mla = args.mla
        self.shape = shape
        hidden, num_heads = args.hidden_size, shape.num_heads
        self.q_proj: Linear | None = None
        self.q_a_proj: Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: Linear | None = None
        if mla.q_lora_rank is None:
            self.q_proj = Linear(hidden, num_heads * mla.qk_head_dim, dtype, device)
        else:
            self.q_a_proj = Linear(hidden, mla.q_lora_rank, dtype, device)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, _LATENT_NORM_EPS, dtype, device)
            self.q_b_proj = Linear(mla.q_lora_rank, num_heads * mla.qk_head_dim, dtype, device)
        self.kv_a_proj = Linear(hidden, mla.latent_dim, dtype, device)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, _LATENT_NORM_EPS, dtype, device)
        self.kv_b = nn.Parameter(torch.empty(num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank,
                                             dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttendFn,
                layer_idx: int) -> torch.Tensor:
        """x [T, hidden] (normed) -> the heads' values [T, H * v_head_dim], for o_proj."""
        mla, num_tokens, num_heads = self.mla, x.shape[0], self.shape.num_heads
        nope, rope, rank = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.kv_lora_rank
        q = self._query(x).view(num_tokens, num_heads, mla.qk_head_dim)
        q_nope, q_rot = q.split([nope, rope], dim=-1)  # [T, H, nope], [T, H, rope]
        latent, k_rot = self.kv_a_proj(x).split([rank, rope], dim=-1)  # [T, rank], [T, rope]
        entry = torch.cat([self.kv_a_layernorm(latent).unsqueeze(1),
                           self._rotate(k_rot.unsqueeze(1), cos, sin)], dim=-1)  # [T, 1, rank + rope]: cached
        w_uk, w_uv = self.kv_b[:, :nope], self.kv_b[:, nope:]  # [H, nope, rank], [H, v, rank]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, rank]
        q_full = torch.cat([q_latent, self._rotate(q_rot, cos, sin)], dim=-1)  # [T, H, rank + rope]
        out = attend(layer_idx, q_full, entry, entry)  # [T, H, rank + rope]; the rope columns are not values
        values = torch.bmm(out[..., :rank].transpose(0, 1), w_uv.transpose(1, 2))  # [H, T, v]
        return values.transpose(0, 1).reshape(num_tokens, num_heads * mla.v_head_dim)

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_proj is not None:
            return self.q_proj(x)
        assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, rope] -> RoPE-rotated [T, H, rope] (de-interleaved first when the pairs are adjacent)."""
        if self.mla.is_rope_interleaved:
            x = x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
        return apply_rope(x, cos, sin)

    def weight_targets(self, p: str) -> dict[str, WeightTarget]:
        """Hugging Face tensor name (`p` is the layer's prefix) -> where it lands in this shard (o_proj is the
        decoder layer's)."""
        mla, s, a = self.mla, self.shape, p + "self_attn."
        q_rows = (0, s.head_offset * mla.qk_head_dim, s.num_heads * mla.qk_head_dim)
        kv_b_width = mla.qk_nope_head_dim + mla.v_head_dim
        targets = {
            a + "kv_a_proj_with_mqa.weight": WeightTarget(plain(self.kv_a_proj), is_transposed=True),
            a + "kv_a_layernorm.weight": WeightTarget(self.kv_a_layernorm.weight),
            a + "kv_b_proj.weight": WeightTarget(self.kv_b.view(-1, mla.kv_lora_rank),
                                                 narrow=(0, s.head_offset * kv_b_width, s.num_heads * kv_b_width)),
        }
        if self.q_proj is not None:
            return targets | {a + "q_proj.weight": WeightTarget(plain(self.q_proj), True, q_rows)}
        assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
        return targets | {a + "q_a_proj.weight": WeightTarget(plain(self.q_a_proj), is_transposed=True),
                          a + "q_a_layernorm.weight": WeightTarget(self.q_a_layernorm.weight),
                          a + "q_b_proj.weight": WeightTarget(plain(self.q_b_proj), True, q_rows)}
