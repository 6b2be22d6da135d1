"""Staging on a CPU worker (one process): its pages are a transfer-engine segment, so moves with this host's
store (a copy on the copy thread) and with another host's store go straight between the pages and the store:
no staging buffer at all; release waits for a same-host copy still running."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from mooncaked.engine.staging_pool import StagingBuffer, StagingPool
from mooncaked.roles.worker.kv.plan import KvPlan, plan_prompt_kv
from mooncaked.roles.worker.kv.request_kv import RequestKv
from mooncaked.roles.worker.kv.spans import StoreBlocks
from mooncaked.roles.worker.worker import Worker
from mooncaked.store import client as client_module
from mooncaked.store.move_ends import Span
from mooncaked.transfer import TransferOp
from tests.roles.worker.test_layerwise_overlap import (BLOCK, assert_same_objects_here_and_there, keys_of,
                                                       load_first_two_blocks, make_config, prefill, prefill_to_remote,
                                                       record_move_ends, running_worker, seed_remote_prefix,
                                                       staging_layer)


def count_acquires(pool: StagingPool, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    acquired: list[int] = []
    acquire = pool.acquire

    def counted(num_blocks: int) -> StagingBuffer:
        acquired.append(num_blocks)
        return acquire(num_blocks)

    monkeypatch.setattr(pool, "acquire", counted)
    return acquired


def in_use(worker: Worker) -> int:
    assert worker.staging_pool is not None
    return worker.staging_pool.num_buffers - len(worker.staging_pool._free)


async def test_moves_with_this_hosts_store_take_no_staging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt stored here, then reused from here (prefill) and loaded whole (decode): not one staging buffer."""
    tokens = [random.Random(11).randrange(3, 300) for _ in range(2 * BLOCK + 5)]
    async with running_worker(make_config(tmp_path)) as worker:
        assert worker.staging_pool is not None and worker.stores.local.is_local
        acquired = count_acquires(worker.staging_pool, monkeypatch)
        keys = keys_of(worker, tokens)
        first = await plan_prompt_kv(worker, "first", tokens, keys, timeout_s=30)
        try:
            expected = await prefill(worker, [first])
            await first.kv.wait_writes(30)
            await first.close_store(commit=True)
            pages = first.kv.page_ids
            kv_before = worker.kv_pages.buffer[:, :, pages[:2]].clone()  # type: ignore[union-attr]
        finally:
            await first.close(commit=False)
        again = await plan_prompt_kv(worker, "again", tokens, keys, timeout_s=30)
        try:
            assert again.num_prefix_blocks == 2
            assert await prefill(worker, [again]) == expected
        finally:
            await again.close(commit=False)
        await load_first_two_blocks(worker, keys, len(tokens), kv_before)
        assert acquired == [] and worker.staging_pool.num_buffers == 0


async def test_a_load_from_another_host_goes_straight_into_the_pages(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode side of a request whose KV sits in another host's store: each layer is read into the pages'
    segment (K and V page ranges), no staging is taken, and the pages then hold the prefix's KV."""
    tokens = [random.Random(12).randrange(3, 300) for _ in range(2 * BLOCK)]
    async with running_worker(make_config(tmp_path)) as worker:
        assert worker.staging_pool is not None and worker.host_pages is not None
        await seed_remote_prefix(worker, tokens)
        remote = await worker.stores.client("s_remote")
        found = await remote.lookup(keys_of(worker, tokens), lease_ms=30_000)
        acquired = count_acquires(worker.staging_pool, monkeypatch)
        segments = record_move_ends(remote, monkeypatch)
        kv = RequestKv(worker, "decode", len(tokens), 8)
        try:
            kv.start_loading([StoreBlocks("s_remote", [0, 1], [loc.offset for loc in found.locations],
                                          found.locations[0].incarnation)], 2)
            await kv.wait_loaded()
            assert segments == [worker.host_pages.name] * worker.kv_pages.num_layers  # type: ignore[union-attr]
            assert acquired == [] and worker.staging_pool.num_buffers == 0
            buffer = np.zeros(2 * worker.block_nbytes, np.uint8)
            await remote.read_blocks(remote.register_staging("check", buffer), found.locations)
            objects = torch.from_numpy(buffer).view(worker.kv_pages.dtype)  # type: ignore[union-attr]
            pages = worker.kv_pages.buffer[:, :, kv.page_ids[:2]]  # type: ignore[union-attr]  # [L, 2, 2, B, H, D]
            assert torch.equal(objects.view(2, *pages.shape[:2], *pages.shape[3:]), pages.permute(2, 0, 1, 3, 4, 5))
        finally:
            await kv.release()
            await remote.release([found.read_lease_id])


async def test_release_waits_for_a_running_direct_copy_and_starts_none_after(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A direct write still copying into a pool region when the request is released: release returns only once
    that copy ended (the plan then aborts the region's handle), and a layer queued after it copies nothing."""
    tokens = [random.Random(13).randrange(3, 300) for _ in range(BLOCK + 3)]
    async with running_worker(make_config(tmp_path)) as worker:
        started, gate = threading.Event(), threading.Event()
        copied_layers: list[int] = []
        copy_spans = client_module._copy_spans

        def gated(pool: np.ndarray, pages: np.ndarray, op: TransferOp, spans: Sequence[Span]) -> None:
            if op is TransferOp.WRITE:
                started.set()
                gate.wait(10)
                copied_layers.append(staging_layer(worker, spans))
            copy_spans(pool, pages, op, spans)

        monkeypatch.setattr(client_module, "_copy_spans", gated)
        plan = await plan_prompt_kv(worker, "late", tokens, keys_of(worker, tokens), timeout_s=30)
        try:
            await worker.compute(plan.kv.store_layer, 0, plan.layer_writes())
            assert await asyncio.to_thread(started.wait, 10)
            release = asyncio.ensure_future(plan.kv.release())
            await asyncio.sleep(0.05)
            assert not release.done(), "release waits while a copy may still write the pool region"
            gate.set()
            await release
            assert plan.kv.is_settled and copied_layers == [0]
            await worker.compute(plan.kv.store_layer, 1, plan.layer_writes())
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wrap_future(plan.kv._writes[-1])
            assert copied_layers == [0], "no copy starts for a released request"
        finally:
            gate.set()
            await plan.close(commit=False)


async def test_reused_blocks_another_host_wants_go_there_from_the_pages(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt whose first blocks are reused from this host's store (straight into the pages) and that another
    host's store wants whole: every block goes there from the pages, the reused ones too, with no staging, and
    equals this host's objects."""
    tokens = [random.Random(14).randrange(3, 300) for _ in range(3 * BLOCK)]
    async with running_worker(make_config(tmp_path)) as worker:
        keys = keys_of(worker, tokens)
        seed = await plan_prompt_kv(worker, "seed", tokens[: 2 * BLOCK] + [7], keys[:2], timeout_s=30)
        try:
            await prefill(worker, [seed])
            await seed.kv.wait_writes(30)
            await seed.close_store(commit=True)
        finally:
            await seed.close(commit=False)

        def check(plan: KvPlan) -> None:
            assert plan.num_prefix_blocks == 2 and plan.kv.staging.buffer is None

        await prefill_to_remote(worker, "r", tokens, keys, check)
        assert len(keys) == 3
        await assert_same_objects_here_and_there(worker, keys)
