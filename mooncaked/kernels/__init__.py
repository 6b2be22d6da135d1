"""Paged-KV attention and copy kernels: one dispatch function per operation.

Stages of use in a forward:
  0. Decode, once per step: `plan_decode_attention` (the torch backend's per-step metadata; None for Triton).
Then per layer:
  1. `store_kv` writes the new tokens' K/V into page slots.
  2. `prefill_attention` or `decode_attention` attends over the pages through block tables.
  3. `gather_blocks` / `scatter_blocks` move whole pages to and from staging buffers.

`backend`: "auto" runs Triton when the tensors are on CUDA and the torch reference otherwise; "triton" forces
Triton (on CPU only under TRITON_INTERPRET=1); "torch" forces the reference. Triton is imported lazily, so
importing this package never compiles or loads a kernel.

Shapes: q [T, H, D]; k, v [T, Hkv, D]; pages [P, B, Hkv, D] (contiguous); block_tables int32 [S, max_blocks];
cu_seqlens_q int32 [S+1]; seq_lens int32 [S] (total tokens per sequence, new ones included); H % Hkv == 0.
Compressed pages (`kv.cache_dtype` int8 or fp8_e4m3) are [P, B, Hkv, D + 2] of uint8 or float8_e4m3fn
(kernels/quantized_kv.py): both backends quantize on store and dequantize what they read (Triton in registers,
kernels/triton_packed.py).
`sliding_window` W (None: unlimited): the query at position p attends to keys p - W + 1 .. p only (Mistral,
and Qwen layers with use_sliding_window), as transformers does; keys outside every window are never read.
"""

from __future__ import annotations

import torch

from mooncaked.kernels import reference
from mooncaked.kernels.quantized_kv import INT8_SCALE_BYTES, is_packed

BACKENDS = ("auto", "triton", "torch")


def resolve_backend(backend: str, tensor: torch.Tensor) -> str:
    """The concrete backend ("triton" or "torch") for `backend` and a tensor of the call."""
    if backend == "auto":
        return "triton" if tensor.is_cuda else "torch"
    if backend in ("triton", "torch"):
        return backend
    raise ValueError(f"unknown kernel backend {backend!r}; use one of {', '.join(BACKENDS)}")


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    slot_mapping: torch.Tensor,
    backend: str = "auto",
) -> None:
    """Write k, v [T, Hkv, D] into k_pages, v_pages [P, B, Hkv, D] at slot_mapping [T] (page_id * B + offset).

    Triton skips rows whose slot is negative (padding rows of a captured decode step); the torch reference,
    which never runs padded batches, does not check (a check would cost a host sync per layer on CPU)."""
    _check_pages(k_pages, v_pages)
    width = k.shape[-1] + INT8_SCALE_BYTES if is_packed(k_pages) else k.shape[-1]
    if k.dim() != 3 or k.shape != v.shape or (k.shape[1], width) != tuple(k_pages.shape[2:]):
        raise ValueError(f"k, v must be [T, Hkv, D] matching pages {tuple(k_pages.shape)}; got {tuple(k.shape)}")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping must be [T={k.shape[0]}], got {tuple(slot_mapping.shape)}")
    if resolve_backend(backend, k) == "torch":
        reference.store_kv(k, v, k_pages, v_pages, slot_mapping)
        return
    _check_triton_device(k, k_pages)
    from mooncaked.kernels import triton_kv

    triton_kv.store_kv(k, v, k_pages, v_pages, slot_mapping)


def prefill_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    backend: str = "auto",
    *,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of new tokens q [T, H, D] over paged K/V (cached prefix + themselves) -> [T, H, D].

    Sequence s owns q rows cu_seqlens_q[s]:cu_seqlens_q[s+1], at absolute positions seq_lens[s] - n_s ..
    seq_lens[s] - 1; their own K/V must already be in the pages (call store_kv first).
    """
    _check_attention(q, k_pages, v_pages, block_tables, seq_lens)
    _check_window(sliding_window)
    if cu_seqlens_q.shape != (seq_lens.shape[0] + 1,):
        raise ValueError(f"cu_seqlens_q must be [S+1={seq_lens.shape[0] + 1}], got {tuple(cu_seqlens_q.shape)}")
    if resolve_backend(backend, q) == "torch":
        return reference.prefill_attention(q, k_pages, v_pages, block_tables, cu_seqlens_q, seq_lens, scale,
                                           sliding_window)
    _check_triton_device(q, k_pages)
    from mooncaked.kernels import triton_prefill

    return triton_prefill.prefill_attention(q, k_pages, v_pages, block_tables, cu_seqlens_q, seq_lens, scale,
                                            sliding_window=sliding_window)


def plan_decode_attention(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    dtype: torch.dtype,
    backend: str = "auto",
    *,
    sliding_window: int | None = None,
) -> reference.DecodePlan | None:
    """What decode_attention would derive from the batch in every layer, derived once per step (torch backend);
    None for Triton, which reads block tables on the device. Pass the result to every layer's decode_attention
    with the same sliding_window (a model mixing windowed and full layers plans once for each)."""
    if block_tables.dim() != 2 or seq_lens.shape != (block_tables.shape[0],) or seq_lens.shape[0] == 0:
        raise ValueError(f"block_tables must be [S >= 1, max_blocks] and seq_lens [S]; got "
                         f"{tuple(block_tables.shape)} and {tuple(seq_lens.shape)}")
    _check_window(sliding_window)
    if resolve_backend(backend, block_tables) == "triton":
        return None
    return reference.plan_decode(block_tables, seq_lens, block_size, dtype, sliding_window)


def decode_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    backend: str = "auto",
    plan: reference.DecodePlan | None = None,
    *,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence, q [S, H, D], over its first seq_lens[s] (>= 1) tokens -> [S, H, D].

    `plan`: plan_decode_attention's result for these block_tables, seq_lens and sliding_window (torch backend;
    else ignored).
    """
    _check_attention(q, k_pages, v_pages, block_tables, seq_lens)
    _check_window(sliding_window)
    if q.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"decode q must have one row per sequence: q has {q.shape[0]}, seq_lens {seq_lens.shape[0]}")
    if resolve_backend(backend, q) == "torch":
        return reference.decode_attention(q, k_pages, v_pages, block_tables, seq_lens, scale, plan, sliding_window)
    _check_triton_device(q, k_pages)
    from mooncaked.kernels import triton_decode

    return triton_decode.decode_attention(q, k_pages, v_pages, block_tables, seq_lens, scale,
                                          sliding_window=sliding_window)


def gather_blocks(pages: torch.Tensor, page_ids: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Copy pages [P, B, Hkv, D] at page_ids int64 [N] into a new staging tensor [N, B, Hkv, D]."""
    _check_page_ids(pages, page_ids)
    if resolve_backend(backend, pages) == "torch":
        return reference.gather_blocks(pages, page_ids)
    _check_triton_device(pages)  # packed pages move as bytes, on any GPU
    from mooncaked.kernels import triton_kv

    return triton_kv.gather_blocks(pages, page_ids)


def scatter_blocks(src: torch.Tensor, pages: torch.Tensor, page_ids: torch.Tensor, backend: str = "auto") -> None:
    """Copy src [N, B, Hkv, D] into pages [P, B, Hkv, D] at page_ids int64 [N], in place."""
    _check_page_ids(pages, page_ids)
    if src.shape != (page_ids.shape[0], *pages.shape[1:]):
        raise ValueError(f"src must be [N={page_ids.shape[0]}, {', '.join(map(str, pages.shape[1:]))}], "
                         f"got {tuple(src.shape)}")
    if resolve_backend(backend, pages) == "torch":
        reference.scatter_blocks(src, pages, page_ids)
        return
    _check_triton_device(pages)  # packed pages move as bytes, on any GPU
    from mooncaked.kernels import triton_kv

    triton_kv.scatter_blocks(src, pages, page_ids)


def _check_triton_device(tensor: torch.Tensor, pages: torch.Tensor | None = None) -> None:
    if tensor.is_cuda:
        if pages is not None and pages.dtype == torch.float8_e4m3fn and torch.cuda.get_device_capability(
                tensor.device) < (8, 9):
            raise ValueError("fp8_e4m3 KV pages need compute capability 8.9 or newer (Ada, Hopper) for the Triton "
                             "kernels; use kv.cache_dtype: int8, or model.kernel_backend: torch")
        return
    import triton

    if not triton.knobs.runtime.interpret:
        raise ValueError("kernel backend 'triton' needs CUDA tensors; on CPU it runs only in Triton's interpreter "
                         "(TRITON_INTERPRET=1 set before triton is imported, as the tests do); use 'torch' or 'auto'")


def _check_window(sliding_window: int | None) -> None:
    if sliding_window is not None and (isinstance(sliding_window, bool) or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or a positive number of tokens, got {sliding_window!r}")


def _check_pages(k_pages: torch.Tensor, v_pages: torch.Tensor) -> None:
    if k_pages.dim() != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages and v_pages must both be [P, B, Hkv, D]; got {tuple(k_pages.shape)} "
                         f"and {tuple(v_pages.shape)}")
    if not (k_pages.is_contiguous() and v_pages.is_contiguous()):
        raise ValueError("k_pages and v_pages must be contiguous")


def _check_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    _check_pages(k_pages, v_pages)
    head_dim = k_pages.shape[3] - INT8_SCALE_BYTES if is_packed(k_pages) else k_pages.shape[3]
    if q.dim() != 3 or q.shape[2] != head_dim:
        raise ValueError(f"q must be [T, H, D={head_dim}], got {tuple(q.shape)}")
    if q.dtype != k_pages.dtype and not is_packed(k_pages):
        raise ValueError(f"q dtype {q.dtype} must match the KV pages' dtype {k_pages.dtype}")
    if q.shape[1] % k_pages.shape[2] != 0:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k_pages.shape[2]})")
    if block_tables.dim() != 2 or seq_lens.shape != (block_tables.shape[0],):
        raise ValueError(f"block_tables must be [S, max_blocks] and seq_lens [S]; got {tuple(block_tables.shape)} "
                         f"and {tuple(seq_lens.shape)}")


def _check_page_ids(pages: torch.Tensor, page_ids: torch.Tensor) -> None:
    if pages.dim() != 4 or not pages.is_contiguous():
        raise ValueError(f"pages must be a contiguous [P, B, Hkv, D] tensor, got shape {tuple(pages.shape)}")
    if page_ids.dim() != 1:
        raise ValueError(f"page_ids must be one-dimensional [N], got {tuple(page_ids.shape)}")
