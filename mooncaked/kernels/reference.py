"""Torch reference implementations of the paged-KV kernels (what CPU inference runs).

Lifecycle of one forward:
  0. Decode only, once per step: `plan_decode` turns block tables and lengths into gather ids and a mask.
Then per layer:
  1. `store_kv` writes the new tokens' K/V into their page slots (slot = page_id * B + offset).
  2. `prefill_attention` (several new tokens per sequence, causal, over a cached prefix) or
     `decode_attention` (one new token per sequence) reads K/V back through the block tables.
  3. `gather_blocks` / `scatter_blocks` move whole pages to and from staging buffers (KV store I/O).

These functions read lengths on the host (`.tolist()`), which is free on CPU; the Triton versions never do.
Shapes: pages [P, B, Hkv, D]; q [T, H, D]; block_tables int32 [S, max_blocks]; H % Hkv == 0.
`sliding_window` W (None: unlimited): the query at position p sees keys p - W + 1 .. p (transformers' rule).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mooncaked.kernels.quantized_kv import as_bytes, dequantize, is_packed, quantize


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k, v [T, Hkv, D] into k_pages, v_pages [P, B, Hkv, D] at flat slots slot_mapping [T]."""
    num_kv_heads, head_dim = k_pages.shape[2], k_pages.shape[3]
    # Conversions only when needed: in a decode step every skipped no-op call is ~4 us per layer on CPU.
    slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.to(torch.int64)
    if is_packed(k_pages):  # compressed rows with their scales (quantized_kv.py), copied as bytes
        k, v = as_bytes(quantize(k, k_pages.dtype)), as_bytes(quantize(v, v_pages.dtype))
        k_pages, v_pages = as_bytes(k_pages), as_bytes(v_pages)
    elif k.dtype != k_pages.dtype:
        k, v = k.to(k_pages.dtype), v.to(v_pages.dtype)
    # view (not reshape): pages are contiguous, so the write lands in the pages themselves.
    k_pages.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
    v_pages.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)


def gather_pages(pages: torch.Tensor, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len tokens of one sequence: [seq_len, Hkv, D]."""
    block_size = pages.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    page_ids = block_table_row[:num_blocks].to(torch.int64)
    return pages.index_select(0, page_ids).flatten(0, 1)[:seq_len]


def prefill_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of q [T, H, D] over each sequence's paged K/V (prefix + new tokens) -> [T, H, D]."""
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    lengths = seq_lens.tolist()
    for s, seq_len in enumerate(lengths):
        q_start, q_end = starts[s], starts[s + 1]
        num_new = q_end - q_start
        if num_new == 0:
            continue
        num_cached = seq_len - num_new
        # Keys before the first query's window are never read: gather from the page holding the first one.
        first_key = 0 if sliding_window is None else max(0, num_cached - sliding_window + 1)
        first_block = first_key // k_pages.shape[1]
        row = block_tables[s, first_block:]
        num_keys = seq_len - first_block * k_pages.shape[1]
        k = gather_pages(k_pages, row, num_keys)  # [L', Hkv, D], key 0 at position first_block * B
        v = k if v_pages is k_pages else gather_pages(v_pages, row, num_keys)  # an MLA latent is its own value
        if is_packed(k_pages):
            k, v = dequantize(k, q.dtype), dequantize(v, q.dtype)
        out[q_start:q_end] = _attend(q[q_start:q_end], k, v, scale, num_cached - first_block * k_pages.shape[1],
                                     sliding_window)
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, num_cached: int,
            sliding_window: int | None) -> torch.Tensor:
    """q [n, H, D] after num_cached keys over k, v [L, Hkv, D], causal within the window -> [n, H, D]."""
    num_new, seq_len = q.shape[0], k.shape[0]
    q4 = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    k4 = k.transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, Hkv, L, D]
    v4 = v.transpose(0, 1).unsqueeze(0).to(q.dtype)
    is_windowed = sliding_window is not None and seq_len > sliding_window
    if num_cached == 0 and not is_windowed:
        o = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # bottom-right aligned causal mask: query i sees keys 0 .. num_cached + i ...
        mask = torch.ones(num_new, seq_len, dtype=torch.bool, device=q.device).tril(num_cached)
        if is_windowed:
            assert sliding_window is not None
            # ... and, in a window, only keys after num_cached + i - W.
            mask.triu_(num_cached - sliding_window + 1)
        o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)


@dataclass(frozen=True)
class DecodePlan:
    """What decode attention derives from block tables and lengths: built once per step, read by every layer."""

    num_seqs: int
    max_len: int  # tokens gathered per sequence: from its first gathered page to the longest end
    page_ids: torch.Tensor  # int64 [S * num_blocks]: num_blocks pages per sequence from its first_blocks entry
    mask: torch.Tensor | None  # [S, 1, 1, max_len] in q's dtype: 0 where attended, -inf elsewhere; None if none
    parts: tuple[DecodePlan, ...] = ()  # one plan per sequence when padding to max_len would waste over half
    sliding_window: int | None = None


def plan_decode(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, dtype: torch.dtype,
                sliding_window: int | None = None) -> DecodePlan:
    """The DecodePlan for block_tables int32 [S, max_blocks] and seq_lens [S] (S >= 1)."""
    lengths = seq_lens.tolist()
    first_blocks = [0 if sliding_window is None else max(0, n - sliding_window) // block_size for n in lengths]
    widths = [n - b * block_size for n, b in zip(lengths, first_blocks)]  # tokens from the first gathered page
    if len(lengths) > 1 and max(widths) * len(widths) > 2 * sum(widths):
        # Padding to the longest context would more than double the K/V bytes gathered (one long document
        # among short chats): attend per sequence instead.
        parts = tuple(_padded_plan(block_tables[s: s + 1], lengths[s: s + 1], first_blocks[s: s + 1], block_size,
                                   dtype, sliding_window) for s in range(len(lengths)))
        no_page_ids = torch.empty(0, dtype=torch.int64, device=block_tables.device)  # the parts hold them
        return DecodePlan(len(lengths), max(widths), no_page_ids, None, parts, sliding_window)
    return _padded_plan(block_tables, lengths, first_blocks, block_size, dtype, sliding_window)


def _padded_plan(block_tables: torch.Tensor, lengths: list[int], first_blocks: list[int], block_size: int,
                 dtype: torch.dtype, sliding_window: int | None) -> DecodePlan:
    device = block_tables.device
    max_len = max(n - b * block_size for n, b in zip(lengths, first_blocks))
    num_blocks = (max_len + block_size - 1) // block_size
    # index_select on flat ids is 3-4x faster on CPU than advanced indexing with a 2-D index.
    if any(first_blocks):
        columns = torch.tensor(first_blocks, device=device)[:, None] + torch.arange(num_blocks, device=device)
        columns.clamp_(max=block_tables.shape[1] - 1)  # past a short sequence's end: masked below
        page_ids = block_tables.gather(1, columns).to(torch.int64).clamp(min=0).flatten()
    else:
        page_ids = block_tables[:, :num_blocks].to(torch.int64).clamp(min=0).flatten()
    if sliding_window is None and min(lengths) == max_len:
        return DecodePlan(len(lengths), max_len, page_ids, None)  # nothing to hide: no mask pass in SDPA
    lens = torch.tensor(lengths, device=device)[:, None]
    positions = torch.tensor(first_blocks, device=device)[:, None] * block_size + torch.arange(max_len, device=device)
    is_hidden = positions >= lens  # [S, max_len]
    if sliding_window is not None:
        is_hidden |= positions < lens - sliding_window
    mask = None
    if bool(is_hidden.any()):
        # An additive float mask: SDPA on CPU runs it ~25% faster than a boolean one.
        mask = torch.zeros(len(lengths), 1, 1, max_len, dtype=dtype, device=device)
        mask.masked_fill_(is_hidden[:, None, None, :], float("-inf"))
    return DecodePlan(len(lengths), max_len, page_ids, mask, (), sliding_window)


def decode_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    plan: DecodePlan | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """One query token per sequence, q [S, H, D], over its first seq_lens[s] paged tokens -> [S, H, D].

    `plan` (from plan_decode on the same block_tables, seq_lens and sliding_window) saves re-deriving it in
    every layer.
    """
    if q.shape[0] == 0:
        return torch.empty_like(q)
    if plan is None:
        plan = plan_decode(block_tables, seq_lens, k_pages.shape[1], q.dtype, sliding_window)
    if plan.num_seqs != q.shape[0]:
        raise ValueError(f"decode plan is for {plan.num_seqs} sequences, q has {q.shape[0]}")
    if plan.sliding_window != sliding_window:
        raise ValueError(f"decode plan is for sliding window {plan.sliding_window}, the call for {sliding_window}")
    if plan.parts:
        return torch.cat([_decode_padded(q[s: s + 1], k_pages, v_pages, part, scale)
                          for s, part in enumerate(plan.parts)])
    return _decode_padded(q, k_pages, v_pages, plan, scale)


def _decode_padded(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, plan: DecodePlan,
                   scale: float) -> torch.Tensor:
    """Every sequence padded to plan.max_len: one gather per pool, one SDPA call."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_pages.shape[1], k_pages.shape[2]
    token_shape = (num_seqs, plan.page_ids.shape[0] // num_seqs * block_size, num_kv_heads, k_pages.shape[3])
    k = k_pages.index_select(0, plan.page_ids).view(token_shape)[:, : plan.max_len]  # [S, Lmax, Hkv, D]
    # an MLA latent is its own value: one gather
    v = k if v_pages is k_pages else v_pages.index_select(0, plan.page_ids).view(token_shape)[:, : plan.max_len]
    if is_packed(k_pages):  # int8 rows [.., D + 2] -> q's dtype [.., D]
        k, v = dequantize(k, q.dtype), dequantize(v, q.dtype)
    # The GROUP query heads of one kv head act as GROUP query rows: no K/V expansion, and SDPA on CPU runs
    # this faster than with enable_gqa.
    o = F.scaled_dot_product_attention(
        q.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim),
        k.transpose(1, 2),  # [S, Hkv, Lmax, D]; pages have q's dtype (the dispatcher checks)
        v.transpose(1, 2),
        attn_mask=plan.mask,
        scale=scale,
    )
    return o.reshape(num_seqs, num_heads, head_dim)


def gather_blocks(pages: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
    """Copy pages [P, B, Hkv, D] at page_ids [N] into a new [N, B, Hkv, D] tensor."""
    return pages.index_select(0, page_ids.to(torch.int64))


def scatter_blocks(src: torch.Tensor, pages: torch.Tensor, page_ids: torch.Tensor) -> None:
    """Copy src [N, B, Hkv, D] into pages at page_ids [N], in place."""
    if is_packed(pages):
        as_bytes(pages).index_copy_(0, page_ids.to(torch.int64), as_bytes(src.view(pages.dtype)))
        return
    pages.index_copy_(0, page_ids.to(torch.int64), src.to(pages.dtype))
