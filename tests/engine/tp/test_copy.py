"""Store objects are the same bytes at every tensor-parallel degree: a tensor-parallel instance's strided copies
(RankPagesEnd, into a mapped pool) and its copier's (KVCopier, into staging rows) put exactly the objects one
instance holding every KV head stages (token-major, the pages' layout), and reading them back fills every rank
(replicas too)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncaked.engine.kv_copy import KVCopier, new_staging
from mooncaked.engine.kv_pages import KVPages
from mooncaked.engine.tp.copy import RankPagesEnd
from mooncaked.engine.tp.pages import ShardedPages
from mooncaked.model.config import ModelArgs
from mooncaked.model.presets import random_preset
from mooncaked.model.tensor_parallel import shard_shape
from mooncaked.store.client import _copy_spans
from mooncaked.store.move_ends import Span
from mooncaked.transfer import TransferOp

NUM_PAGES = 6


def spans_of(pages: KVPages, offsets: list[int], layer: int) -> list[Span]:
    """What RequestKv.layer_spans names through staging: block n's `layer` at pool offsets[n], staging row n."""
    row, size = pages.block_nbytes, pages.layer_block_nbytes
    return [Span(offset + pages.object_layer_offset(layer), n * row + layer * size, size)
            for n, offset in enumerate(offsets)]


def ranks_of(whole: KVPages, num_ranks: int, num_model_kv_heads: int,
             args: ModelArgs | None = None) -> tuple[ShardedPages, list[KVPages]]:
    """`num_ranks` ranks' pages holding `whole`'s KV of their heads (each replica of a replicated head); `args`:
    the model's (default a tiny GQA one of `num_model_kv_heads`)."""
    args = args or random_preset("tiny", num_heads=4, num_kv_heads=num_model_kv_heads, head_dim=whole.head_dim)
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
       by_layer=st.booleans(),
       page_ids=st.lists(st.integers(0, NUM_PAGES - 1), min_size=1, max_size=4, unique=True))
def test_the_copier_stages_the_ranks_pages_as_tp1s(num_kv_heads: int, num_ranks: int, seed: int, by_layer: bool,
                                                   page_ids: list[int]) -> None:
    """The ranks' pages <-> staging rows (moves with another host's store, and every move of CUDA ranks): each
    rank's heads of every row, as KVCopier stages TP=1's pages; loads fill replicas, stores read the first."""
    args = random_preset("tiny", num_heads=4, num_kv_heads=num_kv_heads, head_dim=4)
    whole = KVPages.for_model(args, num_pages=NUM_PAGES, block_size=3, dtype=torch.bfloat16, device="cpu")
    whole.buffer.copy_(torch.randn(whole.buffer.shape, generator=torch.Generator().manual_seed(seed)))
    sharded, ranks = ranks_of(whole, num_ranks, num_kv_heads)
    copier = KVCopier("cpu", backend="torch")
    expected, ours = new_staging(whole, len(page_ids)), new_staging(sharded, len(page_ids))
    copier.store_all_layers(whole, expected, page_ids).synchronize()
    for pages in ranks[1:]:  # a replica of a KV head is never what a store reads
        if pages.kv_head_offset in [p.kv_head_offset for p in ranks[:ranks.index(pages)]]:
            pages.buffer.zero_()
    copy_layers(copier, TransferOp.WRITE, sharded, ours, page_ids, by_layer)
    assert torch.equal(ours, expected)
    for pages in ranks:
        pages.buffer.zero_()
    copy_layers(copier, TransferOp.READ, sharded, ours, page_ids, by_layer)
    for pages in ranks:
        heads = slice(pages.kv_head_offset, pages.kv_head_offset + pages.num_kv_heads)
        assert torch.equal(pages.buffer[:, :, page_ids], whole.buffer[:, :, page_ids][:, :, :, :, heads])


@pytest.mark.parametrize("num_ranks", [1, 2])
def test_an_mla_models_objects_hold_its_latents_once_at_every_degree(num_ranks: int) -> None:
    """One plane of one latent "head" per layer (replicated on every rank): objects of layers x block_size x
    (kv_lora_rank + qk_rope_head_dim) values, the same bytes through staging and straight into a pool, and loads
    fill every rank."""
    args = random_preset("tiny-mla")
    whole = KVPages.for_model(args, num_pages=NUM_PAGES, block_size=3, dtype=torch.float32, device="cpu")
    assert whole.num_planes == 1 and whole.k_pages[1] is whole.v_pages[1]
    assert whole.object_nbytes == args.num_layers * 3 * (32 + 8) * 4
    whole.buffer.copy_(torch.randn(whole.buffer.shape, generator=torch.Generator().manual_seed(num_ranks)))
    sharded, ranks = ranks_of(whole, num_ranks, 1, args)
    page_ids = [4, 1]
    copier = KVCopier("cpu", backend="torch")
    expected, ours = new_staging(whole, len(page_ids)), new_staging(sharded, len(page_ids))
    copier.store_all_layers(whole, expected, page_ids).synchronize()
    assert torch.equal(expected[0, :, 0], whole.buffer[:, 0, 4])  # [layers, block, 1, latent]: the page's bytes
    copy_layers(copier, TransferOp.WRITE, sharded, ours, page_ids, by_layer=True)
    assert torch.equal(ours, expected)
    offsets = [whole.object_nbytes * (2 * n + 1) for n in range(len(page_ids))]
    direct, staged = (np.zeros(whole.object_nbytes * 2 * len(page_ids), np.uint8) for _ in range(2))
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
    assert all(torch.equal(pages.buffer[:, :, page_ids], whole.buffer[:, :, page_ids]) for pages in ranks)


def copy_layers(copier: KVCopier, op: TransferOp, pages: KVPages, staging: torch.Tensor, page_ids: list[int],
                by_layer: bool) -> None:
    if not by_layer:
        handle = (copier.load_all_layers(pages, staging, page_ids) if op is TransferOp.READ
                  else copier.store_all_layers(pages, staging, page_ids))
        handle.synchronize()
        return
    for layer in range(pages.num_layers):
        handle = (copier.load_layer(pages, layer, staging, page_ids) if op is TransferOp.READ
                  else copier.store_layer(pages, layer, staging, page_ids))
        handle.synchronize()


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
