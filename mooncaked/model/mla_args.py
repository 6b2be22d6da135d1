"""Hyperparameters of Multi-head Latent Attention (MLAArgs): DeepSeek-V2/V3 and Kimi K2's attention.

1. model.families reads them from a `deepseek_v3` config.json (q_lora_rank, kv_lora_rank, qk_nope_head_dim,
   qk_rope_head_dim, v_head_dim, rope_interleave); ModelArgs.mla holds them (None: GQA attention).
2. Validation in `__post_init__` raises ValueError naming the Hugging Face field.
3. model.mla builds the attention; the KV cache holds per token and layer only the compressed KV (kv_lora_rank)
   and the shared rope key (qk_rope_head_dim): one plane of one "KV head" of their joint width (ModelArgs'
   num_kv_planes, num_kv_heads, kv_head_dim), which engine.kv_pages, store objects and every KV move size from.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MLAArgs:
    kv_lora_rank: int  # width of the compressed KV (the latent) a token caches per layer
    qk_nope_head_dim: int  # per head: query/key columns without position
    qk_rope_head_dim: int  # per head: query columns, and the shared key's, that RoPE rotates
    v_head_dim: int  # per head: value columns
    q_lora_rank: int | None = None  # the query's low-rank bottleneck (q_a_proj, q_b_proj); None: a plain q_proj
    is_rope_interleaved: bool = True  # rope_interleave: RoPE pairs are adjacent columns (DeepSeek's layout)

    def __post_init__(self) -> None:
        for name, value in (("kv_lora_rank", self.kv_lora_rank), ("qk_nope_head_dim", self.qk_nope_head_dim),
                            ("qk_rope_head_dim", self.qk_rope_head_dim), ("v_head_dim", self.v_head_dim),
                            ("q_lora_rank", 1 if self.q_lora_rank is None else self.q_lora_rank)):
            if value <= 0:
                raise ValueError(f"model config: {name} must be positive, got {value}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"model config: qk_rope_head_dim must be even for RoPE, got {self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """What one token caches per layer: the latent and the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim
