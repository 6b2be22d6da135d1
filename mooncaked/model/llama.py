"""The Llama family as plain PyTorch modules, run one layer at a time by the engine.

1. `LlamaForCausalLM(args, dtype, device)` allocates empty weights (no init cost); Q/K/V and gate/up are fused
   into one matmul each, because on CPU decode every separate matmul is another pass over memory and more
   Python dispatch. Projection weights are stored transposed, [in, out]: MKL runs x @ W for a few rows
   (batched decode) up to ~1.8x faster than x @ W.T (measured at M=8, 576x3072 fp32, 2 threads).
2. `load_hf_state_dict` copies Hugging Face named tensors (from safetensors, GGUF or a random init) into the
   fused parameters.
3. Per forward the runner calls `embed`, `rope.lookup`, then each layer with an `attend` callable that owns
   the paged KV (store, then attention), then `compute_logits` on the rows it needs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from mooncaked.model import packed_gemm
from mooncaked.model.config import ModelArgs
from mooncaked.model.packed_gemm import PACKED_MAX_ROWS, PackedWeight
from mooncaked.model.rope import RopeCache, apply_rope

# attend(layer_idx, q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]) -> attention output [T, H, D]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.shape = (dim,)
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.shape, self.weight, self.eps)


class Linear(nn.Module):
    """Bias-free projection with the weight stored transposed: weight_t [in_features, out_features].

    After `pack_for_cpu()` succeeds, products of at most PACKED_MAX_ROWS rows read an MKL-packed copy instead.
    """

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features, dtype=dtype, device=device),
                                     requires_grad=False)
        self.packed: PackedWeight | None = None

    def pack_for_cpu(self) -> bool:
        """Build the packed copy of the current weight (call again after changing it); False if unavailable."""
        self.packed = packed_gemm.pack(self.weight_t)
        return self.packed is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out]."""
        if self.packed is not None and x.shape[0] <= PACKED_MAX_ROWS:
            return packed_gemm.matmul(x, self.packed)
        return torch.matmul(x, self.weight_t)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + x @ W for 2-D x [T, in] and residual [T, out] (one GEMM when unpacked: no add pass)."""
        if self.packed is not None and x.shape[0] <= PACKED_MAX_ROWS:
            return packed_gemm.matmul(x, self.packed).add_(residual)
        return torch.addmm(residual, x, self.weight_t)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = args.num_heads
        self.num_kv_heads = args.num_kv_heads
        self.head_dim = args.head_dim
        self.q_size = args.q_size
        self.kv_size = args.kv_size
        self.intermediate_size = args.intermediate_size
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device)
        self.qkv_proj = Linear(args.hidden_size, args.q_size + 2 * args.kv_size, dtype, device)
        self.o_proj = Linear(args.q_size, args.hidden_size, dtype, device)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device)
        self.gate_up_proj = Linear(args.hidden_size, 2 * args.intermediate_size, dtype, device)
        self.down_proj = Linear(args.intermediate_size, args.hidden_size, dtype, device)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        """hidden [T, hidden_size] -> [T, hidden_size]."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(self.input_layernorm(hidden))  # [T, q_size + 2 * kv_size]
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = apply_rope(qk, cos, sin)  # q and k rotated together: one set of ops
        q = qk[:, : self.num_heads]
        k = qk[:, self.num_heads:]
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        attn = attend(self.layer_idx, q, k, v)  # [T, H, D]
        hidden = self.o_proj.forward_add(attn.reshape(num_tokens, self.q_size), hidden)
        gate_up = self.gate_up_proj(self.post_attention_layernorm(hidden))  # [T, 2 * intermediate]
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj.forward_add(F.silu(gate).mul_(up), hidden)


class LlamaForCausalLM(nn.Module):
    """Weights and the per-layer compute; holds no per-request state (KV lives in engine.kv_pages)."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.args = args
        self.dtype = dtype
        self.device = torch.device(device)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, dtype=dtype, device="meta")
        self.embed_tokens.weight = nn.Parameter(
            torch.empty(args.vocab_size, args.hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.layers = nn.ModuleList(LlamaDecoderLayer(args, i, dtype, device) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device)
        # a transposed copy even when tied to the embedding: the embedding lookup needs [vocab, hidden] rows
        self.lm_head = Linear(args.hidden_size, args.vocab_size, dtype, device)
        self.rope = RopeCache(args.head_dim, args.rope_theta, args.rope_scaling, args.max_position_embeddings,
                              dtype, device)

    def pack_for_cpu(self) -> int:
        """MKL-pack every projection for fast few-row (decode) GEMMs on CPU; returns how many were packed."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        return sum(linear.pack_for_cpu() for linear in linears)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids int64 [T] -> [T, hidden_size]."""
        return self.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] (pre final norm) -> logits [N, vocab] in fp32."""
        return self.lm_head(self.norm(hidden)).float()

    def load_hf_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy Hugging Face named tensors (`model.layers.0.self_attn.q_proj.weight`, ...) into fused weights."""
        names = set(state)
        with torch.no_grad():
            self._copy("model.embed_tokens.weight", self.embed_tokens.weight, state, names)
            self._copy("model.norm.weight", self.norm.weight, state, names)
            if self.args.tie_word_embeddings:
                self.lm_head.weight_t.copy_(self.embed_tokens.weight.t())
            else:
                self._copy("lm_head.weight", self.lm_head.weight_t, state, names, transpose=True)
            for i, layer in enumerate(self.layers):
                self._load_layer(i, layer, state, names)
        names.discard("lm_head.weight")  # tied checkpoints may still carry a copy
        extra = sorted(n for n in names if "rotary_emb" not in n)
        if extra:
            raise ValueError(f"checkpoint has tensors this Llama does not use: {extra[:5]}")

    def _load_layer(self, i: int, layer: nn.Module, state: Mapping[str, torch.Tensor], names: set[str]) -> None:
        assert isinstance(layer, LlamaDecoderLayer)
        p = f"model.layers.{i}."
        q_end, k_end = layer.q_size, layer.q_size + layer.kv_size
        qkv = layer.qkv_proj.weight_t  # [hidden, q + 2 kv]: HF [out, in] tensors land transposed in column ranges
        gate_up = layer.gate_up_proj.weight_t
        inter = layer.intermediate_size
        self._copy(p + "input_layernorm.weight", layer.input_layernorm.weight, state, names)
        self._copy(p + "post_attention_layernorm.weight", layer.post_attention_layernorm.weight, state, names)
        for name, dst in (("self_attn.q_proj", qkv[:, :q_end]), ("self_attn.k_proj", qkv[:, q_end:k_end]),
                          ("self_attn.v_proj", qkv[:, k_end:]), ("self_attn.o_proj", layer.o_proj.weight_t),
                          ("mlp.gate_proj", gate_up[:, :inter]), ("mlp.up_proj", gate_up[:, inter:]),
                          ("mlp.down_proj", layer.down_proj.weight_t)):
            self._copy(p + name + ".weight", dst, state, names, transpose=True)

    @staticmethod
    def _copy(name: str, dst: torch.Tensor, state: Mapping[str, torch.Tensor], names: set[str],
              transpose: bool = False) -> None:
        if name not in state:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        src = state[name].t() if transpose else state[name]
        if tuple(src.shape) != tuple(dst.shape):
            shape, expected = tuple(state[name].shape), tuple(dst.t().shape if transpose else dst.shape)
            raise ValueError(f"checkpoint tensor {name!r} has shape {shape}, expected {expected}")
        dst.copy_(src)
        names.discard(name)


def random_hf_state_dict(args: ModelArgs, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random fp32 weights with Hugging Face names (std 0.02 like transformers' init; norms near 1)."""
    gen = torch.Generator().manual_seed(seed)
    h, inter = args.hidden_size, args.intermediate_size

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    def norm_weight() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(h, generator=gen)

    state = {"model.embed_tokens.weight": normal(args.vocab_size, h), "model.norm.weight": norm_weight()}
    if not args.tie_word_embeddings:
        state["lm_head.weight"] = normal(args.vocab_size, h)
    for i in range(args.num_layers):
        p = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = norm_weight()
        state[p + "self_attn.q_proj.weight"] = normal(args.q_size, h)
        state[p + "self_attn.k_proj.weight"] = normal(args.kv_size, h)
        state[p + "self_attn.v_proj.weight"] = normal(args.kv_size, h)
        state[p + "self_attn.o_proj.weight"] = normal(h, args.q_size)
        state[p + "post_attention_layernorm.weight"] = norm_weight()
        state[p + "mlp.gate_proj.weight"] = normal(inter, h)
        state[p + "mlp.up_proj.weight"] = normal(inter, h)
        state[p + "mlp.down_proj.weight"] = normal(h, inter)
    return state
