"""Prefill and decode batch layout: slots, block tables, cumulative lengths, validation, chunks."""

from __future__ import annotations

import pytest
import torch

from mooncaked.engine.batch import (DecodeSeq, PrefillSeq, build_decode_batch, build_prefill_batch,
                                    split_prefill_chunks)


def test_prefill_layout_with_cached_prefix() -> None:
    seqs = [PrefillSeq([10, 11, 12], num_cached_tokens=3, page_ids=[5, 2]),
            PrefillSeq([20], num_cached_tokens=0, page_ids=[7])]
    batch = build_prefill_batch(seqs, block_size=4, num_pages=8, device="cpu")
    assert batch.positions.tolist() == [3, 4, 5, 0]
    assert batch.slot_mapping.tolist() == [5 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1, 7 * 4]
    assert batch.block_tables.tolist() == [[5, 2], [7, 0]] and batch.block_tables.dtype == torch.int32
    assert batch.cu_seqlens_q.tolist() == [0, 3, 4] and batch.seq_lens.tolist() == [6, 1]
    assert batch.last_token_indices.tolist() == [2, 3] and batch.num_seqs == 2 and batch.num_tokens == 4


def test_decode_layout() -> None:
    batch = build_decode_batch([DecodeSeq(9, 4, [1, 3]), DecodeSeq(8, 0, [6])], block_size=4, num_pages=8,
                               device="cpu")
    assert batch.slot_mapping.tolist() == [3 * 4, 6 * 4] and batch.seq_lens.tolist() == [5, 1]
    assert batch.input_ids.tolist() == [9, 8] and batch.positions.tolist() == [4, 0]


@pytest.mark.parametrize("seq, message", [
    (PrefillSeq([1, 2, 3, 4, 5], 0, [0]), "need 2 pages, got 1"),
    (PrefillSeq([], 2, [0]), "needs >= 1 new token"),
    (PrefillSeq([1], 0, [9]), r"page ids must be in \[0, 8\)"),
])
def test_prefill_validation(seq: PrefillSeq, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_prefill_batch([seq], block_size=4, num_pages=8, device="cpu")


def test_context_length_is_enforced() -> None:
    with pytest.raises(ValueError, match="exceed the model's context length 4"):
        build_prefill_batch([PrefillSeq([1, 2, 3], 2, [0, 1])], block_size=4, num_pages=8, device="cpu",
                            max_seq_len=4)
    with pytest.raises(ValueError, match="context length 4"):
        build_decode_batch([DecodeSeq(1, 4, [0, 1])], block_size=4, num_pages=8, device="cpu", max_seq_len=4)


def test_decode_validation() -> None:
    with pytest.raises(ValueError, match="need 2 pages"):
        build_decode_batch([DecodeSeq(1, 4, [0])], block_size=4, num_pages=8, device="cpu")
    with pytest.raises(ValueError, match="at least one"):
        build_decode_batch([], block_size=4, num_pages=8, device="cpu")


def test_split_prefill_chunks() -> None:
    chunks = split_prefill_chunks(PrefillSeq(list(range(10)), 4, [0, 1, 2, 3]), max_chunk_tokens=4)
    assert [(list(c.token_ids), c.num_cached_tokens) for c in chunks] == [
        ([0, 1, 2, 3], 4), ([4, 5, 6, 7], 8), ([8, 9], 12)]
