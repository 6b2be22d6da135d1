"""Batch builders: from per-sequence descriptions to the tensors one forward needs.

1. The caller describes each sequence: its new tokens, how many tokens before them are already in pages
   (`num_cached_tokens`: a reused prefix or earlier chunks), and its page ids (the block-table row).
2. `build_prefill_batch` / `build_decode_batch` validate that the pages cover every position (and, given
   `max_seq_len`, the model's context length), then lay out input_ids, positions, slot_mapping,
   block_tables, cu_seqlens_q and seq_lens on the target device.
3. Chunked prefill: `split_prefill_chunks` cuts one long sequence into PrefillSeq chunks; each chunk is one
   `ModelRunner.prefill` call, and the boundary between calls is where a chunk's KV is complete in pages
   (the point a chunked-pipeline prefill would hand the next chunk to another instance).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrefillSeq:
    token_ids: Sequence[int]  # new tokens to compute in this forward
    num_cached_tokens: int  # tokens of this sequence already in pages, before token_ids
    page_ids: Sequence[int]  # block-table row covering num_cached_tokens + len(token_ids) tokens


@dataclass(frozen=True)
class DecodeSeq:
    token_id: int  # last sampled token; its KV is not yet in pages
    num_cached_tokens: int  # tokens already in pages (= this token's position)
    page_ids: Sequence[int]  # covering num_cached_tokens + 1 tokens


@dataclass(frozen=True)
class PrefillBatch:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    slot_mapping: torch.Tensor  # int64 [T], page_id * block_size + offset
    block_tables: torch.Tensor  # int32 [S, max_blocks], padded with 0
    cu_seqlens_q: torch.Tensor  # int32 [S + 1]
    seq_lens: torch.Tensor  # int32 [S], cached + new tokens
    last_token_indices: torch.Tensor  # int64 [S], row of each sequence's last new token in [T]
    num_tokens: int

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


@dataclass(frozen=True)
class DecodeBatch:
    input_ids: torch.Tensor  # int64 [S]
    positions: torch.Tensor  # int64 [S]
    slot_mapping: torch.Tensor  # int64 [S]
    block_tables: torch.Tensor  # int32 [S, max_blocks]
    seq_lens: torch.Tensor  # int32 [S], cached + 1

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


def _check_pages(index: int, num_tokens: int, page_ids: Sequence[int], block_size: int, num_pages: int,
                 max_seq_len: int | None) -> None:
    if max_seq_len is not None and num_tokens > max_seq_len:
        raise ValueError(f"sequence {index}: {num_tokens} tokens exceed the model's context length {max_seq_len}")
    needed = (num_tokens + block_size - 1) // block_size
    if len(page_ids) < needed:
        raise ValueError(f"sequence {index}: {num_tokens} tokens need {needed} pages, got {len(page_ids)}")
    if any(not 0 <= p < num_pages for p in page_ids[:needed]):
        raise ValueError(f"sequence {index}: page ids must be in [0, {num_pages})")


def _slots(page_ids: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    return [page_ids[pos // block_size] * block_size + pos % block_size for pos in range(start, end)]


def _block_tables(rows: Sequence[Sequence[int]], lengths: Sequence[int], block_size: int,
                  device: torch.device | str) -> torch.Tensor:
    num_blocks = [(n + block_size - 1) // block_size for n in lengths]
    width = max(num_blocks, default=0) or 1
    table = [list(row[:n]) + [0] * (width - n) for row, n in zip(rows, num_blocks)]
    return torch.tensor(table, dtype=torch.int32, device=device).reshape(len(rows), width)


def build_prefill_batch(seqs: Sequence[PrefillSeq], *, block_size: int, num_pages: int,
                        device: torch.device | str, max_seq_len: int | None = None) -> PrefillBatch:
    if not seqs:
        raise ValueError("a prefill batch needs at least one sequence")
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    cu_seqlens = [0]
    seq_lens: list[int] = []
    for i, seq in enumerate(seqs):
        start, end = seq.num_cached_tokens, seq.num_cached_tokens + len(seq.token_ids)
        if start < 0 or end == start:
            raise ValueError(f"sequence {i}: needs >= 1 new token and num_cached_tokens >= 0")
        _check_pages(i, end, seq.page_ids, block_size, num_pages, max_seq_len)
        input_ids.extend(seq.token_ids)
        positions.extend(range(start, end))
        slots.extend(_slots(seq.page_ids, start, end, block_size))
        cu_seqlens.append(len(input_ids))
        seq_lens.append(end)
    return PrefillBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=_block_tables([s.page_ids for s in seqs], seq_lens, block_size, device),
        cu_seqlens_q=torch.tensor(cu_seqlens, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        last_token_indices=torch.tensor([c - 1 for c in cu_seqlens[1:]], dtype=torch.int64, device=device),
        num_tokens=len(input_ids),
    )


def build_decode_batch(seqs: Sequence[DecodeSeq], *, block_size: int, num_pages: int,
                       device: torch.device | str, max_seq_len: int | None = None) -> DecodeBatch:
    if not seqs:
        raise ValueError("a decode batch needs at least one sequence")
    for i, seq in enumerate(seqs):
        if seq.num_cached_tokens < 0:
            raise ValueError(f"sequence {i}: num_cached_tokens must be >= 0")
        _check_pages(i, seq.num_cached_tokens + 1, seq.page_ids, block_size, num_pages, max_seq_len)
    positions = [s.num_cached_tokens for s in seqs]
    seq_lens = [p + 1 for p in positions]
    slots = [_slots(s.page_ids, p, p + 1, block_size)[0] for s, p in zip(seqs, positions)]
    return DecodeBatch(
        input_ids=torch.tensor([s.token_id for s in seqs], dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=_block_tables([s.page_ids for s in seqs], seq_lens, block_size, device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
    )


def split_prefill_chunks(seq: PrefillSeq, max_chunk_tokens: int) -> list[PrefillSeq]:
    """Consecutive chunks of at most `max_chunk_tokens` new tokens; chunk j's cached tokens include chunks < j."""
    if max_chunk_tokens <= 0:
        raise ValueError(f"max_chunk_tokens must be positive, got {max_chunk_tokens}")
    chunks = []
    for offset in range(0, len(seq.token_ids), max_chunk_tokens):
        chunks.append(PrefillSeq(token_ids=seq.token_ids[offset: offset + max_chunk_tokens],
                                 num_cached_tokens=seq.num_cached_tokens + offset, page_ids=seq.page_ids))
    return chunks
