"""Store objects are the same bytes at every tensor-parallel degree: a tensor-parallel instance's strided copies
(RankPagesEnd) put exactly the objects one instance holding every KV head stages (token-major, the pages'
layout), into a mapped pool or into staging rows, and reading them back fills every rank (replicas too)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncaked.engine.kv_copy import KVCopier, new_staging
from mooncaked.engine.kv_pages import KVPages
from mooncaked.engine.tp_copy import RankPagesEnd
from mooncaked.engine.tp_pages import ShardedPages
from mooncaked.kv.client import Span, _copy_spans
from mooncaked.model.config import random_preset
from mooncaked.model.tensor_parallel import shard_shape
from mooncaked.rdma import TransferOp

NUM_PAGES = 6


def spans_of(pages: KVPages, offsets: list[int], layer: int) -> list[Span]:
    """What RequestKv.layer_spans names through staging: block n's `layer` at pool offsets[n], staging row n."""
    row, size = pages.block_nbytes, pages.layer_block_nbytes
    return [Span(offset + pages.object_layer_offset(layer), n * row + layer * size, size)
            for n, offset in enumerate(offsets)]


def ranks_of(whole: KVPages, num_ranks: int, num_model_kv_heads: int) -> tuple[ShardedPages, list[KVPages]]:
    """`num_ranks` ranks' pages holding `whole`'s KV of their heads (each replica of a replicated head)."""
    args = random_preset("tiny", num_heads=4, num_kv_heads=num_model_kv_heads, head_dim=whole.head_dim)
    ranks = [KVPages.for_model(args, num_pages=NUM_PAGES, block_size=whole.block_size, dtype=whole.dtype,
                               device="cpu", shard=shard_shape(args, rank, num_ranks)) for rank in range(num_ranks)]
    for pages in ranks:
        pages.buffer.copy_(whole.buffer[:, :, :, :, pages.kv_head_offset: pages.kv_head_offset + pages.num_kv_heads])
    return ShardedPages(ranks, args), ranks


@settings(max_examples=40, deadline=None)
@given(num_kv_heads=st.sampled_from([1, 2, 4]), num_ranks=st.sampled_from([1, 2, 4]),
       block_size=st.integers(1, 5), head_dim=st.sampled_from([2, 4, 6]), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       page_ids=st.lists(st.integers(0, NUM_PAGES - 1), min_size=1, max_size=4, unique=True))
def test_store_objects_are_the_same_bytes_at_every_degree(num_kv_heads: int, num_ranks: int, block_size: int,
                                                          head_dim: int, seed: int, dtype: torch.dtype,
                                                          page_ids: list[int]) -> None:
    """Any degree the KV heads allow (split, or replicated when fewer than the ranks)."""
    args = random_preset("tiny", num_heads=4, num_kv_heads=num_kv_heads, head_dim=head_dim)
    whole = KVPages.for_model(args, num_pages=NUM_PAGES, block_size=block_size, dtype=dtype, device="cpu")
    whole.buffer.copy_(torch.randn(whole.buffer.shape, generator=torch.Generator().manual_seed(seed)))
    sharded, ranks = ranks_of(whole, num_ranks, num_kv_heads)
    assert sharded.object_nbytes == whole.object_nbytes and sharded.block_nbytes == whole.block_nbytes
    expected = new_staging(whole, len(page_ids))
    KVCopier("cpu", backend="torch").store_all_layers(whole, expected, page_ids).synchronize()
    object_nbytes = -(-whole.object_nbytes // 64) * 64
    offsets = [object_nbytes * (2 * n + 1) for n in range(len(page_ids))]  # scattered, not the row order
    direct, staged = (np.zeros(object_nbytes * 2 * len(page_ids), np.uint8) for _ in range(2))
    end = RankPagesEnd(sharded, page_ids)
    for layer in range(whole.num_layers):
        end.copy_spans(direct, TransferOp.WRITE, spans_of(whole, offsets, layer))
        _copy_spans(staged, expected.view(-1).view(torch.uint8).numpy(), TransferOp.WRITE,
                    spans_of(whole, offsets, layer))
    assert np.array_equal(direct, staged) and direct.any()
    for pages in ranks:
        pages.buffer.zero_()
    for layer in range(whole.num_layers):
        end.copy_spans(direct, TransferOp.READ, spans_of(whole, offsets, layer))
    for pages in ranks:  # every rank, replicas of a KV head too
        heads = slice(pages.kv_head_offset, pages.kv_head_offset + pages.num_kv_heads)
        assert torch.equal(pages.buffer[:, :, page_ids], whole.buffer[:, :, page_ids][:, :, :, :, heads])


@settings(max_examples=20, deadline=None)
@given(num_kv_heads=st.sampled_from([1, 2, 4]), num_ranks=st.sampled_from([2, 4]), seed=st.integers(0, 2**16),
       page_ids=st.lists(st.integers(0, NUM_PAGES - 1), min_size=1, max_size=4, unique=True))
def test_staging_rows_copied_for_the_ranks_equal_the_copiers(num_kv_heads: int, num_ranks: int, seed: int,
                                                             page_ids: list[int]) -> None:
    """The ranks' pages <-> staging rows (moves with another host's store), as KVCopier stages TP=1's pages."""
    args = random_preset("tiny", num_heads=4, num_kv_heads=num_kv_heads, head_dim=4)
    whole = KVPages.for_model(args, num_pages=NUM_PAGES, block_size=3, dtype=torch.bfloat16, device="cpu")
    whole.buffer.copy_(torch.randn(whole.buffer.shape, generator=torch.Generator().manual_seed(seed)))
    sharded, ranks = ranks_of(whole, num_ranks, num_kv_heads)
    expected, ours = new_staging(whole, len(page_ids)), new_staging(sharded, len(page_ids))
    KVCopier("cpu", backend="torch").store_all_layers(whole, expected, page_ids).synchronize()
    end, rows = RankPagesEnd(sharded, page_ids), range(len(page_ids))
    flat = ours.view(-1).view(torch.uint8).numpy()
    for layer in range(whole.num_layers):
        end.copy_rows(flat, TransferOp.WRITE, layer, rows)
    assert torch.equal(ours, expected)
    before = [pages.buffer.clone() for pages in ranks]
    for pages in ranks:
        pages.buffer.zero_()
    for layer in range(whole.num_layers):
        end.copy_rows(flat, TransferOp.READ, layer, rows)
    for pages, saved in zip(ranks, before):
        assert torch.equal(pages.buffer[:, :, page_ids], saved[:, :, page_ids])


def test_spans_that_are_not_one_layer_of_one_block_or_outside_the_pool_are_refused() -> None:
    args = random_preset("tiny", num_heads=4, num_kv_heads=2)
    whole = KVPages.for_model(args, num_pages=NUM_PAGES, block_size=4, dtype=torch.float32, device="cpu")
    sharded, _ = ranks_of(whole, 2, 2)
    end, pool = RankPagesEnd(sharded, [0]), np.zeros(whole.object_nbytes, np.uint8)
    size = whole.layer_block_nbytes
    with pytest.raises(ValueError, match="not one layer of one block"):
        end.copy_spans(pool, TransferOp.READ, [Span(0, 0, whole.page_nbytes)])
    with pytest.raises(ValueError, match="not one layer of one block"):
        end.copy_spans(pool, TransferOp.READ, [Span(0, 4, size)])
    with pytest.raises(ValueError, match="outside the pool"):
        end.copy_spans(pool, TransferOp.READ, [Span(whole.object_nbytes, 0, size)])
    with pytest.raises(ValueError, match="outside the request's 1 pages"):
        end.copy_spans(pool, TransferOp.WRITE, [Span(0, whole.block_nbytes, size)])
