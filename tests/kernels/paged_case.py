"""Builds random paged-KV batches and computes attention the naive dense way (independent of the kernels)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedCase:
    """One batch: pages filled with random K/V, a shuffled block table per sequence, and new-token queries."""

    q: torch.Tensor  # [T, H, D]
    k_pages: torch.Tensor  # [P, B, Hkv, D]
    v_pages: torch.Tensor
    block_tables: torch.Tensor  # int32 [S, max_blocks], unused entries -1
    cu_seqlens_q: torch.Tensor  # int32 [S+1]
    seq_lens: torch.Tensor  # int32 [S]


def make_case(
    seq_lens: list[int],
    num_new: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> PagedCase:
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    num_pages = sum(blocks_per_seq) + 3
    page_order = torch.randperm(num_pages, generator=gen)
    max_blocks = max(blocks_per_seq) + 1
    block_tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    used = 0
    for s, nb in enumerate(blocks_per_seq):
        block_tables[s, :nb] = page_order[used : used + nb].to(torch.int32)
        used += nb
    shape = (num_pages, block_size, num_kv_heads, head_dim)
    k_pages = torch.randn(shape, generator=gen).to(dtype)
    v_pages = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(sum(num_new), num_heads, head_dim, generator=gen).to(dtype)
    cu = torch.tensor([0] + num_new, dtype=torch.int32).cumsum(0).to(torch.int32)
    return PagedCase(q, k_pages, v_pages, block_tables, cu, torch.tensor(seq_lens, dtype=torch.int32))


def dense_kv(pages: torch.Tensor, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Token by token: position p lives at page block_table_row[p // B], offset p % B. -> [L, Hkv, D]"""
    block_size = pages.shape[1]
    rows = [pages[int(block_table_row[p // block_size]), p % block_size] for p in range(seq_len)]
    return torch.stack(rows)


def naive_attention(case: PagedCase, scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """Dense causal softmax attention in float64, one sequence at a time -> [T, H, D] float64.

    With sliding_window W the query at position p sees keys p - W + 1 .. p only."""
    num_heads = case.q.shape[1]
    out = torch.empty(case.q.shape, dtype=torch.float64)
    for s, seq_len in enumerate(case.seq_lens.tolist()):
        start, end = int(case.cu_seqlens_q[s]), int(case.cu_seqlens_q[s + 1])
        k = dense_kv(case.k_pages, case.block_tables[s], seq_len).double()
        v = dense_kv(case.v_pages, case.block_tables[s], seq_len).double()
        group = num_heads // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [L, H, D]
        q = case.q[start:end].double()  # [n, H, D]
        scores = torch.einsum("nhd,lhd->hnl", q, k) * scale
        positions = torch.arange(seq_len - (end - start), seq_len)
        keys = torch.arange(seq_len)[None, :]
        scores[:, positions[:, None] < keys] = float("-inf")
        if sliding_window is not None:
            scores[:, keys <= positions[:, None] - sliding_window] = float("-inf")
        out[start:end] = torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)
    return out
