"""Triton prefill attention over paged KV with a cached prefix (FlashAttention-2 style, ragged batch, GQA).

Stages of one launch, grid (query tiles, query heads):
  1. Each program finds its sequence from cu_seqlens_q without any host sync: tiles are numbered sequence by
     sequence (ceil(n_s / BLOCK_M) each); the grid is an upper bound and spare programs exit at once.
     Within a sequence tiles run last-first, so the longest (most keys) tiles start earliest.
  2. With a sliding window W (WINDOW > 0), keys that only some rows' windows reach (the band from the first
     row's oldest key to the last row's) run with the window mask; keys older than the first row's window
     are never read.
  3. Keys before the tile's first query position, and (with a window) inside every row's window, are visible
     to every row: that loop runs without masks.
  4. The remaining keys up to the tile's last query position run with the causal (and window) mask.
  The loops read K/V token by token through the block table (page = block_table[pos // B], offset pos % B),
  so any page size works with any BLOCK_N. Softmax is online in base 2 with fp32 accumulators. Compressed
  pages (KV_FORMAT != 0, kernels/triton_packed.py) are dequantized tile by tile into q's dtype as they are read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mooncaked.kernels.triton_packed import kernel_pages, kv_format, load_kv_tile

LOG2_E = 1.4426950408889634


@dataclass(frozen=True)
class PrefillTiles:
    """Tile sizes and launch shape for the prefill kernel."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@triton.jit  # type: ignore[misc]
def _attend_tile(  # type: ignore[no-untyped-def]
    acc, l_i, m_i, q, q_pos,
    k_pages_ptr, v_pages_ptr, block_table_ptr, kv_head, seq_len, start_n, qk_scale,
    stride_pp, stride_pt, stride_ph,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_MASKED: tl.constexpr, WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FORMAT: tl.constexpr,
):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_mask = offs_n < seq_len
    page = tl.load(block_table_ptr + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
    kv_offs = page * stride_pp + (offs_n % PAGE_SIZE) * stride_pt + kv_head * stride_ph  # [BLOCK_N]
    k = load_kv_tile(k_pages_ptr, kv_offs, offs_d, n_mask, HEAD_DIM, KV_FORMAT).to(q.dtype)  # [BLOCK_N, BLOCK_D]
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N], not yet scaled
    if IS_MASKED:
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        if WINDOW > 0:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - WINDOW)
        qk = tl.where(visible, qk, float("-inf"))
    # The scale is applied inside exp2's argument (one FMA per score) rather than as a pass of its own.
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    m_sub = m_new
    if WINDOW > 0:
        # A row may have seen no key yet (its window starts later): subtract 0, not -inf, so p stays 0, not NaN.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(qk * qk_scale - m_sub[:, None])
    alpha = tl.math.exp2(m_i - m_sub)
    v = load_kv_tile(v_pages_ptr, kv_offs, offs_d, n_mask, HEAD_DIM, KV_FORMAT).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    l_i = l_i * alpha + tl.sum(p, 1)
    return acc, l_i, m_new


@triton.jit  # type: ignore[misc]
def _prefill_kernel(  # type: ignore[no-untyped-def]
    q_ptr, k_pages_ptr, v_pages_ptr, out_ptr, block_tables_ptr, cu_seqlens_ptr, seq_lens_ptr,
    qk_scale, num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_pp, stride_pt, stride_ph,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SEQS_PAD: tl.constexpr, WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KV_FORMAT: tl.constexpr,
):
    tile_id = tl.program_id(0)
    head = tl.program_id(1)
    # Stage 1: which sequence owns tile_id (tiles_end is the inclusive running count of tiles).
    seq_offs = tl.arange(0, SEQS_PAD)
    seq_mask = seq_offs < num_seqs
    q_starts = tl.load(cu_seqlens_ptr + seq_offs, mask=seq_mask, other=0)
    q_ends = tl.load(cu_seqlens_ptr + seq_offs + 1, mask=seq_mask, other=0)
    num_tiles = (q_ends - q_starts + BLOCK_M - 1) // BLOCK_M
    tiles_end = tl.cumsum(num_tiles, 0)
    seq = tl.sum((tiles_end <= tile_id).to(tl.int32), 0)
    if seq >= num_seqs:
        return
    tiles_before = tl.sum(tl.where(seq_offs < seq, num_tiles, 0), 0)
    q_start = tl.load(cu_seqlens_ptr + seq)
    num_new = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    num_cached = seq_len - num_new
    m_start = ((num_new + BLOCK_M - 1) // BLOCK_M - 1 - (tile_id - tiles_before)) * BLOCK_M

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < num_new
    q_rows = (q_start + offs_m).to(tl.int64)
    q_mask = m_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)
    q_pos = num_cached + offs_m
    kv_head = head // GROUP
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Keys [0, unmasked_end) precede every query of the tile (and all lie below seq_len).
    unmasked_end = (num_cached + m_start) // BLOCK_N * BLOCK_N
    band_start = 0
    band_end = 0
    if WINDOW > 0:
        # Stage 2: the first row sees keys from first_pos - W + 1, the last row from last_pos - W + 1.
        band_start = tl.maximum(0, num_cached + m_start - WINDOW + 1) // BLOCK_N * BLOCK_N
        band_end = tl.maximum(0, num_cached + m_start + BLOCK_M - WINDOW)
        band_end = tl.minimum(unmasked_end, (band_end + BLOCK_N - 1) // BLOCK_N * BLOCK_N)
    for start_n in range(band_start, band_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, q_pos, k_pages_ptr, v_pages_ptr, block_table_ptr, kv_head, seq_len, start_n,
            qk_scale, stride_pp, stride_pt, stride_ph,
            HEAD_DIM, BLOCK_D, PAGE_SIZE, BLOCK_N, True, WINDOW, DOT_PRECISION, KV_FORMAT,
        )
    # Stage 3: keys every row sees.
    for start_n in range(band_end, unmasked_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, q_pos, k_pages_ptr, v_pages_ptr, block_table_ptr, kv_head, seq_len, start_n,
            qk_scale, stride_pp, stride_pt, stride_ph,
            HEAD_DIM, BLOCK_D, PAGE_SIZE, BLOCK_N, False, WINDOW, DOT_PRECISION, KV_FORMAT,
        )
    # Stage 4: the diagonal; every row sees its own key, so no valid row ends fully masked.
    masked_end = tl.minimum(seq_len, num_cached + m_start + BLOCK_M)
    for start_n in range(unmasked_end, masked_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, q_pos, k_pages_ptr, v_pages_ptr, block_table_ptr, kv_head, seq_len, start_n,
            qk_scale, stride_pp, stride_pt, stride_ph,
            HEAD_DIM, BLOCK_D, PAGE_SIZE, BLOCK_N, True, WINDOW, DOT_PRECISION, KV_FORMAT,
        )
    if WINDOW > 0:
        l_i = tl.where(l_i == 0.0, 1.0, l_i)  # padding rows past num_new may see no key in a window
    out = acc / l_i[:, None]
    out_ptrs = out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def default_tiles(q: torch.Tensor) -> PrefillTiles:
    """Large tiles on CPU, where the interpreter pays per program. On CUDA the shapes `bench kernels
    --prefill-tiles` measured fastest on an H100 (bf16, 8k-16k tokens; docs/benchmarks.md): 128x64, 4 warps for
    head_dim 64; 128x128, 8 warps for head_dim 128 (20% faster than 128x64 there)."""
    head_dim = q.shape[2]
    if not q.is_cuda:
        return PrefillTiles(block_m=64, block_n=64, num_warps=4, num_stages=1)
    if q.dtype == torch.float32 or head_dim > 128:
        return PrefillTiles(block_m=64, block_n=32, num_warps=4, num_stages=2)
    if head_dim <= 64:
        return PrefillTiles(block_m=128, block_n=64, num_warps=4, num_stages=3)
    return PrefillTiles(block_m=128, block_n=128, num_warps=8, num_stages=3)


def prefill_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    tiles: PrefillTiles | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q [T, H, D] over pages [P, B, Hkv, D] (packed: [P, B, Hkv, D + 2]) -> [T, H, D]; see
    mooncaked.kernels.prefill_attention."""
    tiles = tiles or default_tiles(q)
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    # Upper bound on the tile count: sum(ceil(n_s / M)) <= ceil(T / M) + S.
    grid = (triton.cdiv(num_tokens, tiles.block_m) + num_seqs, num_heads)
    _prefill_kernel[grid](
        q, kernel_pages(k_pages), kernel_pages(v_pages), out, block_tables, cu_seqlens_q, seq_lens,
        scale * LOG2_E, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        GROUP=num_heads // k_pages.shape[2], HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE_SIZE=k_pages.shape[1], BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        SEQS_PAD=triton.next_power_of_2(max(num_seqs, 2)), WINDOW=sliding_window or 0,
        DOT_PRECISION=dot_precision(q.dtype), KV_FORMAT=kv_format(k_pages),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 products (the reference's accuracy); tf32 would cost ~1e-3 relative error."""
    return "ieee" if dtype == torch.float32 else "tf32"
