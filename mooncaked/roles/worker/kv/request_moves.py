"""The byte moves of one request's KV between the stores and its memory (RequestKv's, request_kv.py).

1. The local end of a move with a store (`_memory`): the pages themselves when they are a transfer-engine segment
   (CPU, one process: `is_direct`), the ranks' mapped pages of a tensor-parallel instance on CPU with this host's
   store, else the staging buffer the request holds while the move runs (GPU pages; another host's store of a
   tensor-parallel instance); writes to another host's store from GPU pages registered for RDMA go straight from
   the pages (GPUDirect).
2. `load_layer` (event loop): one layer of every source's blocks into the pages (through staging, then a copy on
   the copy thread, where staged), complete when it returns; RequestKv's LayerLoader calls it layer by layer.
3. `_store_layer_all` (event loop): one layer to every store; staged writes after the copy of their blocks from
   the pages into staging on the copy thread (after the layer's compute on CUDA).
4. A move abandoned mid-flight straight into or out of the pages (`_is_moves_clean` False) may still take late
   bytes: RequestKv.release frees such pages only after transfer.io_timeout_s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from mooncaked.engine.kv_pages import KVPages
from mooncaked.engine.tp.copy import RankPagesEnd
from mooncaked.roles.worker.kv.request_memory import CopyTracker, StagingHold, copy_staging, index_runs
from mooncaked.roles.worker.kv.spans import StoreBlocks, page_spans, staging_spans
from mooncaked.roles.worker.worker import Worker
from mooncaked.store.client import StoreClient
from mooncaked.store.move_ends import LocalEnd, Span, Staging
from mooncaked.transfer import TransferOp

_NO_BYTES = np.empty(0, dtype=np.uint8)  # moves from the pages' segment never touch host bytes


class RequestMoves:
    """The moves of RequestKv (its base): every attribute below is RequestKv's, set in its constructor."""

    worker: Worker
    kv_pages: KVPages
    request_id: str
    page_ids: list[int]
    is_direct: bool
    ranks_end: RankPagesEnd | None
    staging: StagingHold
    copies: CopyTracker
    _is_moves_clean: bool

    def _is_staged(self, client: StoreClient) -> bool:
        """Whether moves with `client`'s store go through staging (GPU pages; ranks' pages, another host's)."""
        return not self.is_direct and not (self.ranks_end is not None and client.is_local)

    def _is_gpudirect(self, client: StoreClient) -> bool:
        """Whether writes to `client`'s store go straight from GPU pages registered for RDMA (another host's)."""
        return self.worker.kv_pages_segment is not None and not self.is_direct and not client.is_local

    def _memory(self, client: StoreClient) -> Staging | LocalEnd:
        """The local end of moves with `client`'s store: the pages, the ranks' pages, or the held staging."""
        if self.worker.host_pages is not None:
            return self.worker.host_pages
        if self.ranks_end is not None and client.is_local:
            return self.ranks_end
        assert self.staging.buffer is not None, "a move through staging runs while the request holds it"
        return Staging(self.staging.buffer.name, self.staging.buffer.array)

    async def _move(self, op: TransferOp, client: StoreClient, spans: Sequence[Span], memory: Staging | LocalEnd,
                    incarnation: int) -> None:
        try:
            await client.move(op, memory, spans, executor=self.copies if client.is_local else None,
                              incarnation=incarnation)
        except BaseException:
            if self.is_direct:  # the transfer engine may still write the pages late
                self._is_moves_clean = False
            raise

    def layer_spans(self, indices: Sequence[int], offsets: Sequence[int], layer: int) -> list[Span]:
        """Layer `layer` of blocks `indices` in this request's memory <-> pool `offsets` (`layer` counts this
        worker's layers: a pipeline stage's layer i is model layer first_layer + i of the store object)."""
        if self.is_direct:
            return page_spans(self.kv_pages, self.page_ids, indices, offsets, layer)
        return staging_spans(self.kv_pages, indices, offsets, layer)

    async def _read(self, source: StoreBlocks, layer: int) -> None:
        client = await self.worker.stores.client(source.store_name)
        spans = self.layer_spans(source.block_indices, source.offsets, layer)
        await self._move(TransferOp.READ, client, spans, self._memory(client), source.incarnation)

    async def _write(self, write: StoreBlocks, layer: int) -> None:
        """Another host's store reads GPU pages straight over RDMA when they are registered (GPUDirect)."""
        client = await self.worker.stores.client(write.store_name)
        if self._is_gpudirect(client):
            assert self.worker.kv_pages_segment is not None
            spans = page_spans(self.kv_pages, self.page_ids, write.block_indices, write.offsets, layer)
            await self._move(TransferOp.WRITE, client, spans, Staging(self.worker.kv_pages_segment, _NO_BYTES),
                             write.incarnation)
            return
        spans = self.layer_spans(write.block_indices, write.offsets, layer)
        await self._move(TransferOp.WRITE, client, spans, self._memory(client), write.incarnation)

    async def _on_copy_thread(self, fn: Callable[..., None], *args: Any) -> None:
        await asyncio.wrap_future(self.copies.submit(fn, *args))

    async def _staged(self, store_names: Sequence[str], is_write: bool = False) -> list[str]:
        """Which of these stores' moves go through staging (writes from GPU pages registered for GPUDirect to
        another host's store do not)."""
        if self.is_direct:
            return []
        clients = [await self.worker.stores.client(name) for name in store_names]
        return [name for name, client in zip(store_names, clients)
                if self._is_staged(client) and not (is_write and self._is_gpudirect(client))]

    async def load_layer(self, layer: int, sources: Sequence[StoreBlocks]) -> None:
        """Event loop: layer `layer` of every source's blocks into the pages, complete when this returns."""
        staged = set(await self._staged([s.store_name for s in sources]))
        if not staged:
            await asyncio.gather(*(self._read(s, layer) for s in sources))
            return
        async with self.staging as (_, view):
            await asyncio.gather(*(self._read(s, layer) for s in sources))
            indices = sorted(i for s in sources if s.store_name in staged for i in s.block_indices)
            await self._copy_staging(TransferOp.READ, layer, indices, view)

    async def _copy_staging(self, op: TransferOp, layer: int, indices: Sequence[int], view: torch.Tensor,
                            compute_done: torch.cuda.Event | None = None) -> None:
        """Staging rows of sorted blocks `indices` <-> their pages, on the copy thread (see copy_staging)."""
        assert self.worker.copier is not None
        await self._on_copy_thread(copy_staging, self.worker.copier, self.kv_pages, self.page_ids, op, layer,
                                   index_runs(indices), view, compute_done)

    async def _store_layer_all(self, layer: int, writes: Sequence[StoreBlocks],
                               compute_done: torch.cuda.Event | None) -> None:
        """Event loop: layer `layer` to every store; staged writes after the copy of their blocks (computed ones,
        and loaded ones another store lacks) from the pages into staging, which holds nothing between moves."""
        timeline = self.worker.timeline
        if timeline is not None:
            timeline.record("store", self.request_id, layer, "start")
        writes = [w for w in writes if w.block_indices]
        staged = set(await self._staged([w.store_name for w in writes], is_write=True))
        if not staged:
            if compute_done is not None and writes:  # GPUDirect writes only: the NIC reads the pages after it
                await self._on_copy_thread(compute_done.synchronize)
            await asyncio.gather(*(self._write(w, layer) for w in writes))
        else:
            async with self.staging as (_, view):
                indices = sorted({i for w in writes if w.store_name in staged for i in w.block_indices})
                await self._copy_staging(TransferOp.WRITE, layer, indices, view, compute_done)
                await asyncio.gather(*(self._write(w, layer) for w in writes))
        if timeline is not None:
            timeline.record("store", self.request_id, layer, "end")
