"""Host pages <-> a mapped pool with no staging (PagesEnd): the pool gets exactly the bytes a move through staging
puts there, at any tensor-parallel degree and pipeline stage, and reading them back fills every rank's pages."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncaked.engine.kv_copy import KVCopier, new_staging
from mooncaked.engine.kv_direct import PagesEnd, page_segment_spans
from mooncaked.engine.kv_pages import KVPages
from mooncaked.engine.tp_pages import ShardedPages
from mooncaked.kv.client import Span, _copy_spans
from mooncaked.model.config import LayerRange, random_preset
from mooncaked.model.tensor_parallel import shard_shape
from mooncaked.rdma import TransferOp

NUM_PAGES = 6


def spans_of(pages: KVPages, offsets: list[int], layer: int) -> list[Span]:
    """What RequestKv.layer_spans names: block n's part of `layer` at pool offsets[n], staging row n."""
    return [Span(offset + in_object, n * pages.block_nbytes + in_row, size)
            for n, offset in enumerate(offsets) for in_object, in_row, size in pages.object_spans(layer)]


def ranks_of(whole: KVPages, num_ranks: int, num_model_kv_heads: int) -> ShardedPages:
    args = random_preset("tiny", num_heads=4, num_kv_heads=num_model_kv_heads, head_dim=whole.head_dim)
    ranks = [KVPages.for_model(args, num_pages=NUM_PAGES, block_size=whole.block_size, dtype=whole.dtype,
                               device="cpu", shard=shard_shape(args, rank, num_ranks)) for rank in range(num_ranks)]
    for pages in ranks:
        heads = slice(pages.kv_head_offset, pages.kv_head_offset + pages.num_kv_heads)
        pages.buffer.copy_(whole.buffer[:, :, :, :, heads])
    return ShardedPages(ranks, args)


@settings(max_examples=40, deadline=None)
@given(num_kv_heads=st.sampled_from([1, 2, 4]), num_ranks=st.sampled_from([1, 2, 4]),
       block_size=st.integers(1, 5), head_dim=st.sampled_from([2, 4, 6]), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       page_ids=st.lists(st.integers(0, NUM_PAGES - 1), min_size=1, max_size=4, unique=True))
def test_direct_moves_put_the_bytes_staging_puts(num_kv_heads: int, num_ranks: int, block_size: int,
                                                 head_dim: int, seed: int, dtype: torch.dtype,
                                                 page_ids: list[int]) -> None:
    args = random_preset("tiny", num_heads=4, num_kv_heads=num_kv_heads, head_dim=head_dim)
    whole = KVPages.for_model(args, num_pages=NUM_PAGES, block_size=block_size, dtype=dtype, device="cpu")
    whole.buffer.copy_(torch.randn(whole.buffer.shape, generator=torch.Generator().manual_seed(seed)))
    pages = whole if num_ranks == 1 else ranks_of(whole, num_ranks, num_kv_heads)
    object_nbytes = -(-pages.object_nbytes // 64) * 64
    offsets = [object_nbytes * (2 * n + 1) for n in range(len(page_ids))]  # scattered, not the row order
    direct, staged = (np.zeros(object_nbytes * 2 * len(page_ids), np.uint8) for _ in range(2))
    staging = new_staging(pages, len(page_ids))
    KVCopier("cpu", backend="torch").store_all_layers(pages, staging, page_ids).synchronize()
    for layer in range(pages.num_layers):
        spans = spans_of(pages, offsets, layer)
        PagesEnd(pages, page_ids).copy_spans(direct, TransferOp.WRITE, spans)
        _copy_spans(staged, staging.view(-1).view(torch.uint8).numpy(), TransferOp.WRITE, spans)
    assert np.array_equal(direct, staged) and direct.any()
    parts = [part for part, _, _ in pages.copy_parts()]
    before = [part.buffer.clone() for part in parts]
    for part in parts:
        part.buffer.zero_()
    for layer in range(pages.num_layers):
        PagesEnd(pages, page_ids).copy_spans(direct, TransferOp.READ, spans_of(pages, offsets, layer))
    for part, expected in zip(parts, before):  # every rank, replicas of a KV head too
        assert torch.equal(part.buffer[:, :, page_ids], expected[:, :, page_ids])


def test_a_pipeline_stage_moves_its_layers_of_the_whole_object() -> None:
    args = random_preset("tiny", num_layers=4)
    stage = KVPages.for_model(args, num_pages=2, block_size=4, dtype=torch.float32, device="cpu",
                              layers=LayerRange(2, 4, 4))
    stage.buffer.copy_(torch.randn(stage.buffer.shape))
    pool = np.zeros(stage.object_nbytes, np.uint8)
    PagesEnd(stage, [1]).copy_spans(pool, TransferOp.WRITE, spans_of(stage, [0], 1))
    layer_nbytes = stage.object_nbytes // 4
    k = torch.from_numpy(pool[3 * layer_nbytes: 3 * layer_nbytes + stage.page_nbytes]).view(torch.float32)
    assert not pool[: 3 * layer_nbytes].any()
    assert torch.equal(k.view(stage.num_kv_heads, 4, stage.head_dim), stage.k_pages[1][1].transpose(0, 1))


def test_spans_that_are_not_whole_heads_or_outside_the_pool_are_refused() -> None:
    pages = KVPages.for_model(random_preset("tiny"), num_pages=2, block_size=4, dtype=torch.float32, device="cpu")
    end, pool = PagesEnd(pages, [0]), np.zeros(pages.object_nbytes, np.uint8)
    with pytest.raises(ValueError, match="not whole KV heads"):
        end.copy_spans(pool, TransferOp.READ, [Span(0, 4, pages.page_nbytes)])
    with pytest.raises(ValueError, match="outside the pool"):
        end.copy_spans(pool, TransferOp.READ, [Span(pages.object_nbytes, 0, pages.page_nbytes)])
    with pytest.raises(ValueError, match="outside the request's 1 pages"):
        end.copy_spans(pool, TransferOp.WRITE, [Span(0, pages.block_nbytes, pages.page_nbytes)])


@pytest.mark.parametrize("num_model_kv_heads,num_ranks", [(1, 1), (2, 2), (4, 4)])
def test_pages_of_one_kv_head_are_their_part_of_the_object_as_they_are(num_model_kv_heads: int,
                                                                       num_ranks: int) -> None:
    """What GPUDirect writes (a pages segment, K and V one range each) is what staging would write."""
    args = random_preset("tiny", num_heads=4, num_kv_heads=num_model_kv_heads)
    pages = KVPages.for_model(args, num_pages=NUM_PAGES, block_size=4, dtype=torch.bfloat16, device="cpu",
                              shard=shard_shape(args, num_ranks - 1, num_ranks))
    pages.buffer.copy_(torch.randn(pages.buffer.shape))
    page_ids, offsets = [4, 1], [3 * pages.object_nbytes, 0]
    staging = new_staging(pages, 2)
    KVCopier("cpu", backend="torch").store_all_layers(pages, staging, page_ids).synchronize()
    from_pages, staged = (np.zeros(4 * pages.object_nbytes, np.uint8) for _ in range(2))
    page_bytes = pages.buffer.view(-1).view(torch.uint8).numpy()
    for layer in range(pages.num_layers):
        _copy_spans(from_pages, page_bytes, TransferOp.WRITE,
                    page_segment_spans(pages, page_ids, [0, 1], offsets, layer))
        _copy_spans(staged, staging.view(-1).view(torch.uint8).numpy(), TransferOp.WRITE,
                    spans_of(pages, offsets, layer))
    assert np.array_equal(from_pages, staged) and staged.any()


@settings(max_examples=20, deadline=None)
@given(num_kv_heads=st.sampled_from([1, 2, 4]), num_ranks=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**16),
       page_ids=st.lists(st.integers(0, NUM_PAGES - 1), min_size=1, max_size=4, unique=True))
def test_staging_rows_copied_by_numpy_equal_the_copiers(num_kv_heads: int, num_ranks: int, seed: int,
                                                        page_ids: list[int]) -> None:
    """Host pages <-> staging rows (moves with another host's store) by PagesEnd.copy_rows, as KVCopier does."""
    args = random_preset("tiny", num_heads=4, num_kv_heads=num_kv_heads, head_dim=4)
    whole = KVPages.for_model(args, num_pages=NUM_PAGES, block_size=3, dtype=torch.bfloat16, device="cpu")
    whole.buffer.copy_(torch.randn(whole.buffer.shape, generator=torch.Generator().manual_seed(seed)))
    pages = whole if num_ranks == 1 else ranks_of(whole, num_ranks, num_kv_heads)
    expected, ours = new_staging(pages, len(page_ids)), new_staging(pages, len(page_ids))
    KVCopier("cpu", backend="torch").store_all_layers(pages, expected, page_ids).synchronize()
    end, rows = PagesEnd(pages, page_ids), range(len(page_ids))
    for layer in range(pages.num_layers):
        end.copy_rows(ours.view(-1).view(torch.uint8).numpy(), TransferOp.WRITE, layer, rows)
    assert torch.equal(ours, expected)
    parts = [part for part, _, _ in pages.copy_parts()]
    before = [part.buffer.clone() for part in parts]
    for part in parts:
        part.buffer.zero_()
    for layer in range(pages.num_layers):
        end.copy_rows(ours.view(-1).view(torch.uint8).numpy(), TransferOp.READ, layer, rows)
    for part, saved in zip(parts, before):
        assert torch.equal(part.buffer[:, :, page_ids], saved[:, :, page_ids])
