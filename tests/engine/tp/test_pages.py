"""A tensor-parallel worker's KV side on CPU: every rank's pages mapped in rank 0 (each holds TP=1's KV of its
heads), the copier's copies between staging rows of whole objects and all of them (the objects TP=1 stages),
and gated prefills whose rank 0 callback raises stop every rank at that layer and leave the group
usable."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from mooncaked.engine.batch import PrefillBatch, PrefillSeq, build_prefill_batch
from mooncaked.engine.kv_copy import KVCopier, new_staging
from mooncaked.engine.kv_pages import KVPages
from mooncaked.engine.runner import ModelRunner
from mooncaked.engine.tp.pages import ShardedPages
from mooncaked.engine.tp.rank import RankSpec
from mooncaked.engine.tp.runner import TensorParallelRunner
from mooncaked.model.loader import load_model
from mooncaked.model.presets import random_preset
from mooncaked.model.tensor_parallel import shard_shape

BLOCK = 8
NUM_PAGES = 8
PROMPT = [3 + (11 * i) % 250 for i in range(21)]
PAGE_IDS = [5, 0, 3]


@pytest.fixture(scope="module")
def tp() -> Iterator[TensorParallelRunner]:
    spec = RankSpec("random:tiny", num_pages=NUM_PAGES, block_size=BLOCK, backend="torch", timeout_s=30.0,
                    is_pages_shared=True)
    runner = TensorParallelRunner.start(spec, 2)
    yield runner
    runner.stop()


def _batch() -> PrefillBatch:
    return build_prefill_batch([PrefillSeq(PROMPT, 0, PAGE_IDS)], block_size=BLOCK, num_pages=NUM_PAGES,
                               device="cpu")


def _single() -> tuple[ModelRunner, KVPages]:
    loaded = load_model("random:tiny")
    kv = KVPages.for_model(loaded.args, num_pages=NUM_PAGES, block_size=BLOCK, dtype=torch.float32, device="cpu")
    return ModelRunner(loaded.model, kv, backend="torch"), kv


def test_each_ranks_mapped_pages_hold_its_heads_of_tp1s_kv(tp: TensorParallelRunner) -> None:
    single, kv = _single()
    expected = single.prefill(_batch())
    logits = tp.prefill(_batch())
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    assert [p.kv_head_offset for p in tp.rank_pages] == [0, 1] and tp.rank_pages[1].num_kv_heads == 1
    for layer in range(kv.num_layers):
        for rank, pages in enumerate(tp.rank_pages):
            torch.testing.assert_close(pages.v_pages[layer][PAGE_IDS], kv.v_pages[layer][PAGE_IDS][:, :, rank:rank + 1],
                                       atol=1e-5, rtol=0)


def test_the_ranks_pages_stage_the_whole_objects_tp1_stages(tp: TensorParallelRunner) -> None:
    single, kv = _single()
    single.prefill(_batch())
    tp.prefill(_batch())
    sharded = ShardedPages(tp.rank_pages, random_preset("tiny"))
    assert sharded.object_nbytes == kv.object_nbytes and sharded.block_nbytes == kv.block_nbytes
    ours, theirs = new_staging(sharded, 3), new_staging(kv, 3)
    copier = KVCopier("cpu", backend="torch")
    copier.store_all_layers(kv, theirs, PAGE_IDS).synchronize()
    copier.store_all_layers(sharded, ours, PAGE_IDS).synchronize()
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    for pages in tp.rank_pages:
        pages.buffer.zero_()
    copier.load_all_layers(sharded, theirs, [1, 2, 4]).synchronize()
    for rank, pages in enumerate(tp.rank_pages):
        assert torch.equal(pages.k_pages[0][[1, 2, 4]], kv.k_pages[0][PAGE_IDS][:, :, rank:rank + 1])


def test_replicated_kv_heads_load_into_every_replica_and_store_from_the_first() -> None:
    args = random_preset("tiny", num_kv_heads=1)
    ranks = [KVPages.for_model(args, num_pages=4, block_size=BLOCK, dtype=torch.float32, device="cpu",
                               shard=shard_shape(args, rank, 2)) for rank in range(2)]
    sharded = ShardedPages(ranks, args)
    assert [writer for _, _, writer in sharded.copy_parts()] == [True, False]
    staging = torch.randn(new_staging(sharded, 1).shape)
    copier = KVCopier("cpu", backend="torch")
    copier.load_all_layers(sharded, staging, [2]).synchronize()
    assert torch.equal(ranks[0].buffer, ranks[1].buffer) and ranks[1].k_pages[1][2].abs().sum() > 0
    ranks[1].buffer.zero_()  # a replica's pages are never read by a store copy
    out = new_staging(sharded, 1)
    copier.store_all_layers(sharded, out, [2]).synchronize()
    assert torch.equal(out, staging)


class Stop(Exception):
    pass


def test_a_raising_callback_stops_every_rank_and_the_group_stays_usable(tp: TensorParallelRunner) -> None:
    seen: list[str] = []

    def before(layer: int) -> None:
        seen.append(f"before {layer}")
        if layer == 1:
            raise Stop("cancelled")

    with pytest.raises(Stop):
        tp.prefill(_batch(), before_layer=before)
    assert seen == ["before 0", "before 1"] and tp.failure is None
    with pytest.raises(Stop):  # after the last layer: the ranks wait there (a split output head all-gathers)
        tp.prefill(_batch(), after_layer=lambda layer: _raise(Stop()) if layer == 1 else None)
    single, _ = _single()
    expected = single.prefill(_batch())
    layers: list[int] = []
    logits = tp.prefill(_batch(), before_layer=layers.append, after_layer=lambda layer: None)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    assert layers == [0, 1]


def _raise(exc: Exception) -> None:
    raise exc
