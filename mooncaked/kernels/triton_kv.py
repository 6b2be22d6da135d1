"""Triton KV copies: scatter new tokens into page slots, and gather/scatter whole pages.

Stages:
  1. `store_kv`: one program per new token copies its [Hkv, D] K and V rows to slot_mapping[t]
     (flat slot = page_id * B + offset; pages are contiguous, so a slot is Hkv * D elements); a negative slot
     (the padding rows of a CUDA-graph decode step) writes nothing. Compressed pages (kv.cache_dtype int8,
     fp8_e4m3) get each row quantized in registers and written as [D + 2] bytes (kernels/triton_packed.py).
  2. `gather_blocks` / `scatter_blocks`: programs (page, chunk) copy BLOCK elements of one page between the
     page pool and a contiguous staging tensor.
All page offsets are computed in int64: P * B * Hkv * D easily exceeds 2**31 elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mooncaked.kernels.triton_packed import kernel_pages, kv_format, store_packed_rows

COPY_BLOCK = 4096


@triton.jit  # type: ignore[misc]
def _store_kv_kernel(  # type: ignore[no-untyped-def]
    k_ptr, v_ptr, k_pages_ptr, v_pages_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    num_kv_heads,
    HEAD_DIM: tl.constexpr, ROW_WIDTH: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    KV_FORMAT: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = (heads < num_kv_heads) & (slot >= 0)  # slot -1: a padding row, skipped
    mask = row_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows = slot * num_kv_heads * ROW_WIDTH + heads * ROW_WIDTH  # [BLOCK_H] offsets of the destination rows
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + offs_d[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + offs_d[None, :], mask=mask, other=0.0)
    if KV_FORMAT == 0:
        dst = rows[:, None] + offs_d[None, :]
        tl.store(k_pages_ptr + dst, k.to(k_pages_ptr.dtype.element_ty), mask=mask)
        tl.store(v_pages_ptr + dst, v.to(v_pages_ptr.dtype.element_ty), mask=mask)
    else:
        store_packed_rows(k_pages_ptr, rows, offs_d, k.to(tl.float32), row_mask, HEAD_DIM, KV_FORMAT)
        store_packed_rows(v_pages_ptr, rows, offs_d, v.to(tl.float32), row_mask, HEAD_DIM, KV_FORMAT)


@triton.jit  # type: ignore[misc]
def _copy_pages_kernel(  # type: ignore[no-untyped-def]
    src_ptr, dst_ptr, page_ids_ptr, page_numel,
    IS_GATHER: tl.constexpr, BLOCK: tl.constexpr,
):
    index = tl.program_id(0).to(tl.int64)
    page = tl.load(page_ids_ptr + index).to(tl.int64)
    if IS_GATHER:
        src_page = page
        dst_page = index
    else:
        src_page = index
        dst_page = page
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < page_numel
    x = tl.load(src_ptr + src_page * page_numel + offs, mask=mask)
    tl.store(dst_ptr + dst_page * page_numel + offs, x.to(dst_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v [T, Hkv, D] (any token/head strides) -> k_pages, v_pages [P, B, Hkv, D] (packed: [P, B, Hkv, D + 2])
    at slot_mapping [T]."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = _unit_last_stride(k), _unit_last_stride(v)
    _store_kv_kernel[(num_tokens,)](
        k, v, kernel_pages(k_pages), kernel_pages(v_pages), slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        num_kv_heads,
        HEAD_DIM=head_dim, ROW_WIDTH=k_pages.shape[3], BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), KV_FORMAT=kv_format(k_pages),
    )


def gather_blocks(pages: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
    """pages [P, B, Hkv, D] at page_ids [N] -> new contiguous [N, B, Hkv, D]."""
    out = torch.empty((page_ids.shape[0], *pages.shape[1:]), dtype=pages.dtype, device=pages.device)
    _copy_pages(kernel_pages(pages), kernel_pages(out), page_ids, is_gather=True)
    return out


def scatter_blocks(src: torch.Tensor, pages: torch.Tensor, page_ids: torch.Tensor) -> None:
    """src [N, B, Hkv, D] -> pages [P, B, Hkv, D] at page_ids [N], in place."""
    _copy_pages(kernel_pages(src.contiguous()), kernel_pages(pages), page_ids, is_gather=False)


def _copy_pages(src: torch.Tensor, dst: torch.Tensor, page_ids: torch.Tensor, is_gather: bool) -> None:
    num_pages = page_ids.shape[0]
    if num_pages == 0:
        return
    page_numel = dst[0].numel()
    grid = (num_pages, triton.cdiv(page_numel, COPY_BLOCK))
    _copy_pages_kernel[grid](src, dst, page_ids, page_numel, IS_GATHER=is_gather, BLOCK=COPY_BLOCK)


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
