"""The decoder every supported family shares (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, DeepSeek-V3), as plain
PyTorch modules.

1. `LlamaForCausalLM(args, dtype, device, shape)` allocates empty weights (no init cost) for the heads and
   MLP columns `shape` names (the whole model on one device). Q/K/V and gate/up are fused into one matmul
   each, because on CPU decode every separate matmul is another pass over memory and more Python dispatch.
   Projection weights are stored transposed, [in, out]: MKL runs x @ W for a few rows (batched decode) up to
   ~1.8x faster than x @ W.T (measured at M=8, 576x3072 fp32, 2 threads).
   The families differ only in ModelArgs flags: q/k/v (and o, MLP) biases, q/k RMSNorm before RoPE (Qwen3),
   per-layer sliding windows (applied by the runner's attention), tied embeddings, RoPE scaling, a
   Mixture-of-Experts MLP on the layers `args.moe` names (model.moe), and Multi-head Latent Attention in place of
   GQA with `args.mla` (model.mla; o_proj stays the layer's).
   With `is_weights_deferred` it allocates none: `bind_weights(views)` then makes each parameter a given tensor
   (a view of the host's memory-mapped weight file, model.weight_file; `weight_layout()` lists what it needs).
2. `load_weights(named tensors)` streams Hugging Face named tensors (safetensors, GGUF or a random init)
   into the fused parameters, one at a time, checking names and shapes (model.weight_names); a tensor-parallel
   shard (model.tensor_parallel) takes its slices (`weight_slices()`: a safetensors reader reads only those).
   `pack_for_cpu(is_replacing)` adds MKL-packed copies of the projections, or (a decode process) puts them in
   the plain ones' place (model.packed_gemm).
3. Per forward the runner calls `embed`, `rope.lookup`, then each layer with an `attend` callable that owns
   the paged KV (store, then attention), then `compute_logits` on the rows it needs. A tensor-parallel shard
   all-reduces o_proj's and down_proj's outputs over the process's group (every rank runs the same
   forward in step; engine.tp.runner drives them).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from mooncaked.model import tensor_parallel
from mooncaked.model.config import LayerRange, ModelArgs, ShardShape
from mooncaked.model.layers import Linear, RMSNorm
from mooncaked.model.mla import AttendFn, LatentAttention
from mooncaked.model.moe import SparseMoE
from mooncaked.model.rope import RopeCache, apply_rope
from mooncaked.model.tensor_parallel import Slice, sliced_shape
from mooncaked.model.weight_names import CheckpointError, check_complete, check_tensor, hf_tensor_shapes, is_ignored
from mooncaked.model.weight_targets import WeightTarget, attention_targets, mlp_targets, plain



class LlamaDecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, shape: ShardShape, layer_idx: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.shape = shape
        self.num_heads = shape.num_heads
        self.num_kv_heads = shape.num_kv_heads
        self.head_dim = shape.head_dim
        self.q_size = shape.q_size
        self.kv_size = shape.kv_size
        self.intermediate_size = shape.intermediate_size
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device)
        is_bias_rank = shape.rank == 0  # row-parallel biases are added once, by rank 0
        self.qkv_proj: Linear | None = None
        self.latent_attention: LatentAttention | None = None
        if args.mla is None:
            self.qkv_proj = Linear(args.hidden_size, shape.q_size + 2 * shape.kv_size, dtype, device, args.qkv_bias)
            self.o_proj = Linear(shape.q_size, args.hidden_size, dtype, device, args.o_bias and is_bias_rank)
        else:
            self.latent_attention = LatentAttention(args, shape, dtype, device)
            self.o_proj = Linear(shape.num_heads * args.mla.v_head_dim, args.hidden_size, dtype, device)
        self.q_norm = RMSNorm(shape.head_dim, args.rms_norm_eps, dtype, device) if args.qk_norm else None
        self.k_norm = RMSNorm(shape.head_dim, args.rms_norm_eps, dtype, device) if args.qk_norm else None
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device)
        self.moe: SparseMoE | None = None
        self.gate_up_proj: Linear | None = None
        self.down_proj: Linear | None = None
        if args.moe is not None and args.moe.is_sparse(layer_idx):
            self.moe = SparseMoE(args.moe, args.hidden_size, shape, dtype, device)
        else:
            self.gate_up_proj = Linear(args.hidden_size, 2 * shape.intermediate_size, dtype, device, args.mlp_bias)
            self.down_proj = Linear(shape.intermediate_size, args.hidden_size, dtype, device,
                                    args.mlp_bias and is_bias_rank)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        """hidden [T, hidden_size] -> [T, hidden_size]."""
        if self.latent_attention is not None:
            attn = self.latent_attention(self.input_layernorm(hidden), cos, sin, attend, self.layer_idx)  # [T, H * v_head_dim]
        else:
            attn = self._attention(self.input_layernorm(hidden), cos, sin, attend)  # [T, q_size]
        hidden = self._row_parallel(self.o_proj, attn, hidden)
        if self.moe is not None:
            return self._moe(hidden)
        assert self.gate_up_proj is not None and self.down_proj is not None
        gate_up = self.gate_up_proj(self.post_attention_layernorm(hidden))  # [T, 2 * intermediate]
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self._row_parallel(self.down_proj, F.silu(gate).mul_(up), hidden)

    def _attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        """GQA: x [T, hidden_size] (normed) -> the heads' outputs [T, q_size], for o_proj."""
        assert self.qkv_proj is not None
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads:])], dim=1)
        qk = apply_rope(qk, cos, sin)  # q and k rotated together: one set of ops
        q = qk[:, : self.num_heads]
        k = qk[:, self.num_heads:]
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        return attend(self.layer_idx, q, k, v).reshape(num_tokens, self.q_size)  # [T, H, D] -> [T, q_size]

    def _moe(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden_size] + the MoE MLP of its norm; a shard's partial output is all-reduced, rank 0
        adding the residual."""
        assert self.moe is not None
        out = self.moe(self.post_attention_layernorm(hidden))
        if self.shape.num_ranks == 1 or self.shape.rank == 0:
            out.add_(hidden)
        if self.shape.num_ranks > 1:
            tensor_parallel.all_reduce(out)
        return out

    def weight_targets(self, p: str) -> dict[str, WeightTarget]:
        """Hugging Face tensor name (`p` + name in the layer) -> where it lands (model.weight_targets)."""
        norms = {"input_layernorm.weight": self.input_layernorm.weight,
                 "post_attention_layernorm.weight": self.post_attention_layernorm.weight}
        if self.q_norm is not None and self.k_norm is not None:
            norms.update({"self_attn.q_norm.weight": self.q_norm.weight, "self_attn.k_norm.weight": self.k_norm.weight})
        targets = {p + name: WeightTarget(weight) for name, weight in norms.items()}
        if self.latent_attention is not None:
            v_width = self.latent_attention.mla.v_head_dim
            columns = (1, self.shape.head_offset * v_width, self.shape.num_heads * v_width)
            targets |= self.latent_attention.weight_targets(p) | {
                p + "self_attn.o_proj.weight": WeightTarget(plain(self.o_proj), True, columns)}
        else:
            assert self.qkv_proj is not None
            targets |= attention_targets(p, self.shape, self.qkv_proj, self.o_proj)
        if self.moe is not None:
            return targets | self.moe.weight_targets(p)
        assert self.gate_up_proj is not None and self.down_proj is not None
        return targets | mlp_targets(p, self.shape, self.gate_up_proj, self.down_proj)

    def _row_parallel(self, linear: Linear, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + x @ W (+ bias), W's input columns split across the ranks: each rank's partial product is
        summed by an all-reduce over the process's group (model.tensor_parallel); rank 0 adds the residual and
        bias."""
        if self.shape.num_ranks == 1:
            return linear.forward_add(x, residual)
        out = linear.forward_add(x, residual) if self.shape.rank == 0 else linear(x)
        tensor_parallel.all_reduce(out)
        return out


class LlamaForCausalLM(nn.Module):
    """Weights and the per-layer compute; holds no per-request state (KV lives in engine.kv_pages). A pipeline
    stage holds only `layers` (the embedding only on the first stage, the final norm and head on the last).

    With `is_weights_deferred` the weights take no memory (meta tensors) until `bind_weights` places them, e.g.
    in a memory-mapped weight file (model.weight_file).
    """

    def __init__(self, args: ModelArgs, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", shape: ShardShape | None = None,
                 layers: LayerRange | None = None, is_weights_deferred: bool = False) -> None:
        super().__init__()
        self.args = args
        self.shape = shape or ShardShape.whole(args)
        self.layer_range = layers or LayerRange.whole(args)
        self.dtype = dtype
        self.device = torch.device(device)
        weight_device = "meta" if is_weights_deferred else device
        self.embed_tokens: nn.Embedding | None = None
        if self.layer_range.has_embedding:
            self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, dtype=dtype, device="meta")
            self.embed_tokens.weight = nn.Parameter(
                torch.empty(args.vocab_size, args.hidden_size, dtype=dtype, device=weight_device), requires_grad=False)
        self.layers = nn.ModuleList(LlamaDecoderLayer(args, self.shape, i, dtype, weight_device)
                                    for i in range(self.layer_range.start, self.layer_range.end))
        self.norm: RMSNorm | None = None
        self.lm_head: Linear | None = None
        if self.layer_range.has_head:
            self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, weight_device)
            # a transposed copy even when tied to the embedding: the embedding lookup needs [vocab, hidden] rows
            self.lm_head = Linear(args.hidden_size, self.shape.vocab_size or args.vocab_size, dtype, weight_device)
        self.rope = RopeCache(args.rope_head_dim, args.rope_theta, args.rope_scaling, args.context_length,
                              dtype, device, args.rope_freq_factors)
        self.head_fp32: torch.Tensor | None = None  # [hidden, vocab]: keep_fp32_head's copy of the output head

    def pack_for_cpu(self, is_replacing: bool = False) -> int:
        """MKL-pack every projection for fast few-row (decode) GEMMs on CPU; returns how many were packed.
        With `is_replacing`, each packed projection drops its plain weight and reads the packed copy for every
        row count (a decode process: the weights are held once)."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        return sum(linear.pack_for_cpu(is_replacing) for linear in linears)

    def keep_fp32_head(self) -> None:
        """A bf16/fp16 model on CPU: keep an fp32 copy of the output head (call again after changing its weight),
        so logits are computed and stored in fp32. In bf16 a logit near 20 rounds to a multiple of 0.125, and
        near-ties then flip greedy choices (SmolLM2 in bf16 answered the README's question wrongly with a bf16
        head, rightly with this one). On a GPU the head stays in the model's dtype."""
        if self.lm_head is not None and self.lm_head.weight_t is not None:
            self.head_fp32 = self.lm_head.weight_t.float()

    def weight_layout(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(parameter name, shape, section) of every weight: `projections` for Linear weights, else `resident`."""
        return [(name, tuple(param.shape), "projections" if name.endswith("weight_t") else "resident")
                for name, param in self.named_parameters()]

    def bind_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Make every parameter the tensor of its name in `tensors` (same shape and dtype; nothing is copied)."""
        for name, param in list(self.named_parameters()):
            tensor = tensors[name]
            assert tensor.shape == param.shape and tensor.dtype == param.dtype, (name, tensor.shape, param.shape)
            module_name, _, attr = name.rpartition(".")
            setattr(self.get_submodule(module_name), attr, nn.Parameter(tensor, requires_grad=False))

    def weight_nbytes(self) -> dict[str, int]:
        """Bytes held now: `plain` parameters and `packed` copies (and the fp32 head; nothing counted twice)."""
        plain = sum(p.numel() * p.element_size() for p in self.parameters())
        packed = sum(m.out_features * m.in_features * self.dtype.itemsize for m in self.modules()
                     if isinstance(m, Linear) and m.packed is not None)
        if self.head_fp32 is not None:
            packed += self.head_fp32.numel() * self.head_fp32.element_size()
        return {"plain": plain, "packed": packed}

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids int64 [T] -> [T, hidden_size] (first stage only)."""
        assert self.embed_tokens is not None, "this pipeline stage holds no embedding"
        return self.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] (pre final norm) -> logits [N, vocab] in fp32 (last stage only). A shard of a
        vocabulary-split head gathers every rank's columns (every rank must call it)."""
        assert self.norm is not None and self.lm_head is not None, "this pipeline stage holds no output head"
        if self.head_fp32 is not None:
            logits = torch.matmul(self.norm(hidden).float(), self.head_fp32)
        else:
            logits = self.lm_head(self.norm(hidden)).float()
        return logits if self.shape.vocab_size is None else tensor_parallel.all_gather(logits)

    def load_hf_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy a whole Hugging Face state dict (`model.layers.0.self_attn.q_proj.weight`, ...) into the weights."""
        self.load_weights(state.items(), source="state dict")

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint",
                     is_sliced: bool = False) -> None:
        """Copy Hugging Face named tensors as they come; CheckpointError names a missing, unexpected, repeated or
        mis-shaped one. Ignorable tensors (model.weight_names.is_ignored) and, on a pipeline stage, the other
        stages' tensors are skipped. `is_sliced`: the tensors `weight_slices()` names come as those slices."""
        slices = self.weight_slices() if is_sliced else {}
        expected = {name: sliced_shape(shape, slices.get(name)) for name, shape in hf_tensor_shapes(self.args).items()}
        needed = hf_tensor_shapes(self.args, self.layer_range)
        targets = self.weight_targets()
        seen: set[str] = set()
        with torch.no_grad():
            for name, tensor in tensors:
                if is_ignored(name, self.args):
                    continue
                check_tensor(name, tuple(tensor.shape), expected, source)
                if name in seen:
                    raise CheckpointError(f"{source}: tensor {name!r} appears twice")
                seen.add(name)
                if name in needed:
                    for target in targets.get(name, ()):  # a row-parallel bias has none on ranks > 0
                        target.copy_from(tensor, name in slices)
            check_complete(seen & set(needed), needed, source)

    def weight_slices(self) -> dict[str, Slice]:
        """Hugging Face tensor name -> the (dim, start, length) part of it this shard holds, for each tensor it
        holds only part of (none at TP=1); an empty slice for a tensor of its layers it holds none of (another
        expert-parallel rank's experts, a row-parallel bias on ranks > 0), so a reader reads none of its bytes."""
        if self.shape.num_ranks == 1:
            return {}
        targets = self.weight_targets()
        slices = {name: t[0].narrow for name, t in targets.items() if t[0].narrow is not None}
        return slices | {name: (0, 0, 0) for name in hf_tensor_shapes(self.args, self.layer_range)
                         if name not in targets}

    def weight_targets(self) -> dict[str, list[WeightTarget]]:
        """Every Hugging Face tensor name of this shard and stage -> where it lands (the embedding of a model with
        tied embeddings also in the transposed output head)."""
        targets: dict[str, list[WeightTarget]] = {}
        if self.embed_tokens is not None:
            targets["model.embed_tokens.weight"] = [WeightTarget(self.embed_tokens.weight)]
        if self.norm is not None and self.lm_head is not None:
            targets["model.norm.weight"] = [WeightTarget(self.norm.weight)]
            rows = None if self.shape.vocab_size is None else (0, self.shape.vocab_offset, self.shape.vocab_size)
            head = WeightTarget(plain(self.lm_head), is_transposed=True, narrow=rows)
            head_name = "model.embed_tokens.weight" if self.args.tie_word_embeddings else "lm_head.weight"
            targets.setdefault(head_name, []).append(head)
        for layer in self.layers:
            assert isinstance(layer, LlamaDecoderLayer)
            for name, target in layer.weight_targets(f"model.layers.{layer.layer_idx}.").items():
                targets[name] = [target]
        return targets
