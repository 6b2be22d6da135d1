"""One request's KV on a worker: its pages, its host staging buffer, and the byte moves to and from stores.

1. `RequestKv(worker, request_id, num_tokens)` allocates pages for every block of the prompt (the partial tail
   included) plus `num_extra_tokens`, and a staging buffer [num_blocks, layers, 2, block_size, kv_heads,
   head_dim] in the store's object layout (DESIGN 5).
2. `read_blocks(store, indices, offsets)` fills staging from a store's pool (whole objects); `load_layer(i)`
   then moves layer i of the first `num_loaded` blocks into pages (the runner's before-layer hook).
3. `store_layer(i, start)` copies layer i of blocks `start..` from pages into staging (the after-layer hook, on
   the compute thread) and `post_write_layer` hands the store writes to the event loop, so layer i is sent
   while layer i+1 computes; `wait_writes()` awaits them all.
4. `release()` frees pages and unregisters staging from the transfer engine; the caller owns store handles and
   leases and ends them (commit, abort, release) before it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Sequence

import torch

from mooncaked.kv.client import Span, Staging, StoreClient
from mooncaked.rdma import TransferOp
from mooncaked.roles.worker.worker import Worker

logger = logging.getLogger(__name__)


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class RequestKv:
    """Owns one request's pages, staging buffer, staging registrations and in-flight writes."""

    def __init__(self, worker: Worker, request_id: str, num_tokens: int, num_extra_tokens: int = 0) -> None:
        assert worker.pages is not None and worker.kv_pages is not None
        self.worker = worker
        self.request_id = request_id
        self.num_tokens = num_tokens
        self.num_blocks = num_blocks_for(num_tokens, worker.block_size)
        self.num_full_blocks = num_tokens // worker.block_size
        num_pages = num_blocks_for(num_tokens + num_extra_tokens, worker.block_size)
        self.page_ids: list[int] = worker.pages.allocate(num_pages, owner=request_id)
        self.staging = worker.new_staging(self.num_blocks)
        self.num_loaded = 0
        self._registered: dict[str, Staging] = {}
        self._writes: list[concurrent.futures.Future[None]] = []
        self._is_released = False

    def _staging_for(self, store_name: str, client: StoreClient) -> Staging:
        staging = self._registered.get(store_name)
        if staging is None:
            byte_view = self.staging.view(-1).view(torch.uint8)
            staging = client.register_staging(f"{self.request_id}/{store_name}", byte_view)
            self._registered[store_name] = staging
        return staging

    async def _move(self, op: TransferOp, store_name: str, spans: Sequence[Span]) -> None:
        client = await self.worker.store_client(store_name)
        await client.move(op, self._staging_for(store_name, client), spans)

    def block_spans(self, indices: Sequence[int], offsets: Sequence[int]) -> list[Span]:
        size = self.worker.block_nbytes
        return [Span(offset, index * size, size) for index, offset in zip(indices, offsets)]

    def layer_spans(self, indices: Sequence[int], offsets: Sequence[int], layer: int) -> list[Span]:
        block, size = self.worker.block_nbytes, self.worker.layer_nbytes
        return [Span(offset + layer * size, index * block + layer * size, size)
                for index, offset in zip(indices, offsets)]

    async def read_blocks(self, store_name: str, indices: Sequence[int], offsets: Sequence[int]) -> None:
        await self._move(TransferOp.READ, store_name, self.block_spans(indices, offsets))

    async def write_blocks(self, store_name: str, indices: Sequence[int], offsets: Sequence[int]) -> None:
        await self._move(TransferOp.WRITE, store_name, self.block_spans(indices, offsets))

    async def write_layer(self, store_name: str, indices: Sequence[int], offsets: Sequence[int], layer: int) -> None:
        await self._move(TransferOp.WRITE, store_name, self.layer_spans(indices, offsets, layer))

    def post_write_layer(self, store_name: str, indices: Sequence[int], offsets: Sequence[int], layer: int) -> None:
        """From the compute thread: send layer `layer` of blocks `indices` to `offsets` in a store's pool."""
        if indices:
            self._writes.append(self.worker.post(self.write_layer(store_name, indices, offsets, layer)))

    async def wait_writes(self, timeout_s: float) -> None:
        writes, self._writes = self._writes, []
        if writes:
            await asyncio.wait_for(asyncio.gather(*(asyncio.wrap_future(w) for w in writes)), timeout_s)

    async def settle_writes(self, timeout_s: float) -> None:
        """Let in-flight writes end, well or not, so their destinations may be freed without a late write."""
        writes, self._writes = self._writes, []
        if writes:
            await asyncio.wait([asyncio.wrap_future(w) for w in writes], timeout=timeout_s)

    def load_layer(self, layer: int) -> None:
        """Compute thread: staging[:num_loaded, layer] -> pages (blocks 0..num_loaded)."""
        if self.num_loaded == 0:
            return
        worker = self.worker
        assert worker.copier is not None and worker.kv_pages is not None
        handle = worker.copier.load_layer(worker.kv_pages, layer, self.staging[: self.num_loaded],
                                          self.page_ids[: self.num_loaded])
        handle.wait_on_current_stream()

    def load_all_layers(self, num_blocks: int) -> None:
        """Compute thread: staging[:num_blocks] (every layer) -> pages."""
        worker = self.worker
        assert worker.copier is not None and worker.kv_pages is not None
        if num_blocks:
            worker.copier.load_all_layers(worker.kv_pages, self.staging[:num_blocks],
                                          self.page_ids[:num_blocks]).synchronize()

    def store_layer(self, layer: int, start: int) -> None:
        """Compute thread: pages -> staging[start:, layer], complete when this returns."""
        worker = self.worker
        assert worker.copier is not None and worker.kv_pages is not None
        if start < self.num_blocks:
            handle = worker.copier.store_layer(worker.kv_pages, layer, self.staging[start:],
                                               self.page_ids[start: self.num_blocks])
            handle.synchronize()

    async def release(self) -> None:
        """Free pages and staging registrations; idempotent. In-flight writes are cancelled."""
        if self._is_released:
            return
        self._is_released = True
        for write in self._writes:
            write.cancel()
        self._writes = []
        assert self.worker.pages is not None
        self.worker.pages.free_owner(self.request_id)
        for store_name, staging in self._registered.items():
            client = await self.worker.store_client(store_name)
            client.unregister_staging(staging)
        self._registered.clear()
