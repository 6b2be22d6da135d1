"""Triton paged decode attention, split along the KV length (flash-decoding), with GQA.

Stages:
  1. Host: choose num_splits from the batch shape alone (no sync on seq_lens): enough programs to fill the
     device, but at least MIN_TOKENS_PER_SPLIT tokens of the block-table capacity per split.
  2. Split kernel, grid (S, Hkv, num_splits): one program takes all GROUP query heads of one kv head (rows of a
     tl.dot, padded to >= 16) over its chunk of the sequence, so each K/V byte is read once per kv head.
     The chunk is ceil(num_keys / num_splits) rounded up to BLOCK_N, so short sequences leave trailing splits
     empty; those record lse = -inf. num_keys is seq_len, or with a sliding window W (WINDOW > 0) at most W:
     the keys before seq_len - W are never read. It writes partial outputs [S, H, splits, D] and base-2
     lse [S, H, splits]. Compressed pages (KV_FORMAT != 0, kernels/triton_packed.py) are dequantized tile by
     tile into q's dtype as they are read.
  3. Reduce kernel, grid (S, H): out = sum_i 2^(lse_i - max) * o_i / sum_i 2^(lse_i - max).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from mooncaked.kernels.triton_packed import kernel_pages, kv_format, load_kv_tile
from mooncaked.kernels.triton_prefill import LOG2_E, dot_precision

MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 128
PROGRAMS_PER_SM = 4


@dataclass(frozen=True)
class DecodeTiles:
    """Tile sizes and the split count (None: chosen from the batch shape and device)."""

    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int | None = None


@triton.jit  # type: ignore[misc]
def _decode_split_kernel(  # type: ignore[no-untyped-def]
    q_ptr, k_pages_ptr, v_pages_ptr, block_tables_ptr, seq_lens_ptr, part_out_ptr, part_lse_ptr,
    qk_scale, num_splits,
    stride_qs, stride_qh, stride_bt, stride_pp, stride_pt, stride_ph,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    KV_FORMAT: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP
    seq_len = tl.load(seq_lens_ptr + seq)
    first_key = 0
    if WINDOW > 0:
        first_key = tl.maximum(0, seq_len - WINDOW)
    chunk = tl.cdiv(tl.cdiv(seq_len - first_key, num_splits), BLOCK_N) * BLOCK_N
    start = first_key + split * chunk
    end = tl.minimum(start + chunk, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    d_mask = offs_d < HEAD_DIM
    q_mask = (offs_g < GROUP)[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)
    block_table_ptr = block_tables_ptr + seq * stride_bt

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        page = tl.load(block_table_ptr + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_offs = page * stride_pp + (offs_n % PAGE_SIZE) * stride_pt + kv_head * stride_ph  # [BLOCK_N]
        k = load_kv_tile(k_pages_ptr, kv_offs, offs_d, n_mask, HEAD_DIM, KV_FORMAT).to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N]
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        v = load_kv_tile(v_pages_ptr, kv_offs, offs_d, n_mask, HEAD_DIM, KV_FORMAT).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    # An empty split has l_i = 0 and m_i = -inf: it stores o = 0 and lse = -inf (weight 0 in the reduction).
    is_empty = l_i == 0.0
    out = acc / tl.where(is_empty, 1.0, l_i)[:, None]
    lse = tl.where(is_empty, float("-inf"), m_i + tl.math.log2(tl.where(is_empty, 1.0, l_i)))
    rows = (seq * num_heads + heads) * num_splits + split  # [BLOCK_G] index into [S, H, splits]
    tl.store(part_out_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], out, mask=q_mask)
    tl.store(part_lse_ptr + rows, lse, mask=offs_g < GROUP)


@triton.jit  # type: ignore[misc]
def _decode_reduce_kernel(  # type: ignore[no-untyped-def]
    part_out_ptr, part_lse_ptr, out_ptr, num_splits, stride_os, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = seq * tl.num_programs(1) + head
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    lse = tl.load(part_lse_ptr + row * num_splits + offs_s, mask=s_mask, other=float("-inf"))
    weights = tl.math.exp2(lse - tl.max(lse, 0))  # split 0 is never empty, so the max is finite
    o_mask = s_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(part_out_ptr + (row * num_splits + offs_s)[:, None] * HEAD_DIM + offs_d[None, :], mask=o_mask, other=0.0)
    out = tl.sum(o * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


@lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def default_tiles(q: torch.Tensor) -> DecodeTiles:
    """Memory-bound on GPU: 64-token tiles, double-buffered; a single big tile per step in the interpreter."""
    if not q.is_cuda:
        return DecodeTiles(block_n=64, num_warps=4, num_stages=1)
    return DecodeTiles(block_n=64, num_warps=4, num_stages=2)


def choose_num_splits(q: torch.Tensor, num_kv_heads: int, max_tokens: int) -> int:
    """Splits so that S * Hkv * splits fills the device, each split covering >= MIN_TOKENS_PER_SPLIT tokens."""
    num_sms = _num_sms(q.device.index or 0) if q.is_cuda else 4
    wanted = triton.cdiv(PROGRAMS_PER_SM * num_sms, q.shape[0] * num_kv_heads)
    return max(1, min(wanted, triton.cdiv(max_tokens, MIN_TOKENS_PER_SPLIT), MAX_SPLITS))


def decode_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    tiles: DecodeTiles | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q [S, H, D] over pages [P, B, Hkv, D] (packed: [P, B, Hkv, D + 2]) -> [S, H, D]; see
    mooncaked.kernels.decode_attention."""
    tiles = tiles or default_tiles(q)
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, page_size = k_pages.shape[2], k_pages.shape[1]
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    max_keys = block_tables.shape[1] * page_size
    if sliding_window is not None:
        max_keys = min(max_keys, sliding_window)
    num_splits = tiles.num_splits or choose_num_splits(q, num_kv_heads, max_keys)
    part_out = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, kernel_pages(k_pages), kernel_pages(v_pages), block_tables, seq_lens, part_out, part_lse,
        scale * LOG2_E, num_splits,
        q.stride(0), q.stride(1), block_tables.stride(0), k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        PAGE_SIZE=page_size, BLOCK_N=tiles.block_n, WINDOW=sliding_window or 0, DOT_PRECISION=dot_precision(q.dtype),
        KV_FORMAT=kv_format(k_pages), num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    _decode_reduce_kernel[(num_seqs, num_heads)](
        part_out, part_lse, out, num_splits, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, SPLITS_PAD=triton.next_power_of_2(max(num_splits, 2)),
    )
    return out
