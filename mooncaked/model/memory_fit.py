"""Whether a model's weights fit the device before any of them is allocated.

1. `weight_bytes(args, dtype, packing)`: what LlamaForCausalLM holds for `args` in `dtype`: every checkpoint
   tensor, the transposed output head copy of tied models, the RoPE tables, and with `packing="both"` a second
   (MKL-packed) copy of every projection; `packed` replaces the plain projections, so it holds as much as `plain`.
2. `activation_bytes(args, num_tokens, num_logit_rows, dtype)`: an estimate of one forward's transient
   tensors (hidden states, q/k/v, the MLP's intermediate, fp32 logits), the workspace a worker keeps free.
3. `free_bytes(device)`: free device memory (CUDA: the driver's free figure; CPU: MemAvailable, which counts
   the page cache a memory-mapped checkpoint occupies as reclaimable).
4. `check_fits(...)` raises ModelDoesNotFit naming both sizes and what to change.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mooncaked.model.config import LayerRange, ModelArgs
from mooncaked.model.packed_gemm import Packing
from mooncaked.model.weight_names import hf_tensor_shapes
from mooncaked.runtime.errors import StartupError

GIB = 1 << 30
_MEMINFO = Path("/proc/meminfo")


class ModelDoesNotFit(StartupError, ValueError):
    """The weights need more memory than the device has free; the message gives both figures."""


def weight_bytes(args: ModelArgs, dtype: torch.dtype, packing: Packing = "plain",
                 layers: LayerRange | None = None, num_ranks: int = 1) -> int:
    """Of the whole model, or of the pipeline stage holding `layers`; with `num_ranks`, of one tensor-parallel
    rank (its share of the layers' projections and of the output head; embedding and norms replicated)."""
    layers = layers or LayerRange.whole(args)
    shapes = hf_tensor_shapes(args, layers)
    num_elements = sum(_numel(shape) for shape in shapes.values()) + 2 * args.context_length * args.rope_head_dim
    sharded = sum(_numel(shape) for name, shape in shapes.items() if _is_sharded(name))
    num_elements -= sharded - sharded // num_ranks
    embedding = args.vocab_size * args.hidden_size
    head = embedding // num_ranks if args.vocab_size % num_ranks == 0 else embedding  # split by vocabulary rows
    if args.tie_word_embeddings and layers.has_head:
        num_elements += head  # lm_head's transposed copy
    elif layers.has_head:
        num_elements -= embedding - head
    if args.tie_word_embeddings and layers.has_head and not layers.has_embedding:
        num_elements -= embedding  # a last stage reads the embedding only into its head
    both = projection_bytes(args, dtype, layers) if packing == "both" else 0
    return num_elements * dtype.itemsize + both


_REPLICATED = ("norm", "mlp.gate.", "q_a_proj", "kv_a_proj_with_mqa")  # the MoE router, MLA's down-projections


def _is_sharded(name: str) -> bool:
    """Split across tensor-parallel ranks (column- or row-wise, or whole experts)."""
    return ("self_attn." in name or "mlp." in name) and not any(part in name for part in _REPLICATED)


def projection_bytes(args: ModelArgs, dtype: torch.dtype, layers: LayerRange | None = None) -> int:
    """Bytes of every projection: each 2-D weight but the embedding, the output head included."""
    layers = layers or LayerRange.whole(args)
    num_elements = sum(_numel(shape) for name, shape in hf_tensor_shapes(args, layers).items()
                       if len(shape) == 2 and name != "model.embed_tokens.weight")
    if args.tie_word_embeddings and layers.has_head:
        num_elements += args.vocab_size * args.hidden_size
    return num_elements * dtype.itemsize


def activation_bytes(args: ModelArgs, num_tokens: int, num_logit_rows: int, dtype: torch.dtype) -> int:
    """Transient bytes of a forward over `num_tokens` tokens producing `num_logit_rows` rows of logits: per token
    the residual stream, its normed copy and the attention output (3 x hidden), q/k/v before and after RoPE
    (2 x qkv; MLA: the query, its absorbed form and the attention output, each head as wide as the cached entry),
    the MLP's gate/up and product (3 x intermediate; a MoE layer's per chosen expert, plus its gathered input and
    output rows); fp32 logits and their softmax."""
    qkv = args.q_size + 2 * args.kv_size
    if args.mla is not None:
        qkv = args.q_size + args.num_heads * (args.mla.latent_dim + args.mla.v_head_dim) + args.mla.latent_dim
    mlp = 3 * args.intermediate_size
    if args.moe is not None:
        moe = args.moe
        routed = moe.num_experts_per_token * (3 * moe.intermediate_size + 2 * args.hidden_size)
        mlp = max(mlp, routed + 3 * moe.shared_intermediate_size)
    per_token = 3 * args.hidden_size + 2 * qkv + mlp
    return num_tokens * per_token * dtype.itemsize + 2 * num_logit_rows * args.vocab_size * 4


def free_bytes(device: torch.device) -> int | None:
    """Free memory on `device` in bytes, or None where it cannot be measured."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"model.device is {device} but this torch sees no CUDA device; use cpu or install a "
                             "CUDA build of torch on a GPU host")
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type != "cpu" or not _MEMINFO.is_file():
        return None
    for line in _MEMINFO.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def check_fits(args: ModelArgs, dtype: torch.dtype, device: torch.device, packing: Packing, label: str,
               available: int | None = None, layers: LayerRange | None = None, num_ranks: int = 1) -> None:
    """ModelDoesNotFit when the weights of `args` (of the stage holding `layers`, of one of `num_ranks`
    tensor-parallel ranks) exceed `available` (default: free_bytes(device))."""
    needed = weight_bytes(args, dtype, packing, layers, num_ranks)
    available = free_bytes(device) if available is None else available
    if available is None or needed <= available:
        return
    hint = "a smaller model, a smaller dtype (model.dtype: bfloat16)" if dtype.itemsize > 2 else "a smaller model"
    if packing == "both":
        hint += ", model.cpu_packed_gemm: false (the packed copy doubles the projections)"
    raise ModelDoesNotFit(f"{label} does not fit: its weights need {needed / GIB:.2f} GiB as {dtype} on {device} "
                          f"but only {available / GIB:.2f} GiB is free; use {hint}, or a device with more memory")


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count
