"""One request's KV on a worker: its pages, its host staging buffer, and the byte moves to and from stores.

1. `RequestKv(worker, request_id, num_tokens)` allocates pages for every block of the prompt (the partial tail
   included) plus `num_extra_tokens`, and a staging buffer [num_blocks, layers, 2, kv_heads, block_size,
   head_dim] in the store's head-major object layout (DESIGN 5, engine/kv_pages.py) from the worker's staging
   pool: pages are token-major, so every move goes through staging and a transposing copy (on CPU pages too).
2. Loading: `start_loading(sources, num_blocks)` (event loop) starts a LayerLoader: layer by layer from the
   stores into staging, then pages (a copy on the copy thread). The forward waits per layer
   (`wait_layer_loaded`, compute thread); a caller that needs all of it awaits `wait_loaded`.
3. Storing: `store_layer(i, start, writes)` (compute thread, after layer i) queues layer i's writes to every
   store (event loop, after the copy of layer i of blocks `start..` into staging on the copy thread) and
   returns: layer i is sent while layer i+1 computes. At most `worker.max_layers_in_flight` layers are in
   flight; beyond, the compute thread waits for the oldest.
   `wait_writes()` awaits them all (and reports a failed load). Same-host copies run on the copy thread,
   others on the transfer engine's threads: none on the compute thread.
4. `release()` stops the loader, waits for queued copies, frees the pages and gives the staging back; the
   caller owns store handles and leases and ends them (commit, abort, release) before it. Memory a move was
   abandoned in (cancelled, failed mid-flight) may still take late bytes: staging is dropped, not reused (moves
   never touch the pages, so they are freed at once; a release cancelled mid-wait frees them after the deadline).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mooncaked.kv.client import Span, Staging
from mooncaked.rdma import TransferOp
from mooncaked.roles.worker.layer_loader import BlockSource, LayerLoader, LoadFailed
from mooncaked.roles.worker.worker import Worker

logger = logging.getLogger(__name__)

def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class LayerWrite:
    """Each layer of blocks `indices` goes to pool `offsets` of store `store_name`."""

    store_name: str
    indices: list[int]
    offsets: list[int]
    incarnation: int = 0  # the store run the offsets belong to (kv/client.py); 0: unchecked


class RequestKv:
    """Owns one request's pages, staging buffer (GPU pages), loader, queued copies and in-flight writes."""

    def __init__(self, worker: Worker, request_id: str, num_tokens: int, num_extra_tokens: int = 0) -> None:
        assert worker.pages is not None and worker.kv_pages is not None and worker.staging_pool is not None
        self.worker = worker
        self.request_id = request_id
        self.num_tokens = num_tokens
        self.num_blocks = num_blocks_for(num_tokens, worker.block_size)
        self.num_full_blocks = num_tokens // worker.block_size
        num_pages = num_blocks_for(num_tokens + num_extra_tokens, worker.block_size)
        self.page_ids: list[int] = worker.pages.allocate(num_pages, owner=request_id)
        self._buffer = worker.staging_pool.acquire(self.num_blocks)
        self.staging = worker.staging_pool.view(self._buffer, self.num_blocks)
        self.num_loaded = 0
        self.loader: LayerLoader | None = None
        self.store_error: Exception | None = None
        self._copies: list[concurrent.futures.Future[None]] = []
        self._writes: list[concurrent.futures.Future[None]] = []
        self._is_moves_clean = True  # no move into or out of this request's memory was abandoned mid-flight
        self._is_released = False

    # ---- moves between stores and this request's memory (event loop) ------------------------------------
    def _memory(self) -> Staging:
        """The local end of this request's moves: its staging buffer."""
        return Staging(self._buffer.name, self._buffer.array)

    async def _move(self, op: TransferOp, store_name: str, spans: Sequence[Span], memory: Staging,
                    incarnation: int) -> None:
        client = await self.worker.store_client(store_name)
        executor = self.worker.copy_thread if client.is_local else None
        try:
            await client.move(op, memory, spans, executor=executor, incarnation=incarnation)
        except BaseException:
            self._is_moves_clean = False
            raise

    def layer_spans(self, indices: Sequence[int], offsets: Sequence[int], layer: int) -> list[Span]:
        """Layer `layer` of blocks `indices` in staging <-> pool `offsets` (`layer` counts this worker's layers:
        a pipeline stage's layer i is model layer first_layer + i of the store object; a tensor-parallel rank
        moves its KV heads' ranges of it)."""
        kv_pages = self.worker.kv_pages
        assert kv_pages is not None
        row, parts = kv_pages.block_nbytes, kv_pages.object_spans(layer)
        return [Span(offset + in_object, index * row + in_row, size)
                for index, offset in zip(indices, offsets) for in_object, in_row, size in parts]

    async def read_layer(self, store_name: str, indices: Sequence[int], offsets: Sequence[int], layer: int,
                         incarnation: int = 0) -> None:
        spans = self.layer_spans(indices, offsets, layer)
        await self._move(TransferOp.READ, store_name, spans, self._memory(), incarnation)

    async def write_layer(self, store_name: str, indices: Sequence[int], offsets: Sequence[int], layer: int,
                          incarnation: int = 0) -> None:
        spans = self.layer_spans(indices, offsets, layer)
        await self._move(TransferOp.WRITE, store_name, spans, self._memory(), incarnation)

    # ---- loading ---------------------------------------------------------------------------------------
    def start_loading(self, sources: Sequence[BlockSource], num_blocks: int) -> None:
        """Event loop: load blocks [0, num_blocks) of every layer from `sources` into the pages."""
        self.num_loaded = num_blocks
        if num_blocks:
            self.loader = LayerLoader(self, sources, num_blocks)
            self.loader.start()

    def copy_layer_in(self, layer: int, num_blocks: int) -> None:
        """Copy thread: staging[:num_blocks, layer] -> pages, complete when this returns."""
        worker = self.worker
        assert worker.copier is not None and worker.kv_pages is not None
        worker.copier.load_layer(worker.kv_pages, layer, self.staging[:num_blocks],
                                 self.page_ids[:num_blocks]).synchronize()

    def wait_layer_loaded(self, layer: int) -> bool:
        """Compute thread, before layer `layer`: True once it is in the pages, False if this request's loading
        failed (the forward then sends nothing more for it)."""
        if self.loader is None:
            return True
        return self.loader.wait_layer(layer, self.worker.section.kv_load_timeout_s)

    async def wait_loaded(self) -> None:
        if self.loader is not None:
            await self.loader.wait_all(self.worker.section.kv_load_timeout_s)

    @property
    def is_failed(self) -> bool:
        return self.store_error is not None or (self.loader is not None and self.loader.error is not None)

    def raise_failure(self) -> None:
        if self.loader is not None and self.loader.error is not None:
            raise self.loader.error
        if self.store_error is not None:
            raise self.store_error

    # ---- storing ---------------------------------------------------------------------------------------
    def store_layer(self, layer: int, start: int, writes: Sequence[LayerWrite]) -> None:
        """Compute thread, right after layer `layer` was computed (queued, on CUDA): see stage 3."""
        if self.is_failed or not self._wait_store_window():
            return
        worker = self.worker
        assert worker.copier is not None
        compute_done = worker.copier.mark_compute()  # layer `layer`'s end: the copy waits for nothing later
        copy = worker.copy_thread.submit(self._copy_layer_out, layer, start, compute_done)
        self._copies.append(copy)
        self._writes.append(worker.post(self._write_layer_all(copy, layer, writes)))

    def _wait_store_window(self) -> bool:
        limit = self.worker.section.max_layers_in_flight
        pending = [w for w in self._writes if not w.done()]
        if len(pending) < limit:
            return True
        timeout_s = self.worker.config.transfer.timeout_s
        _, not_done = concurrent.futures.wait(pending[: len(pending) - limit + 1], timeout=timeout_s)
        if not_done:
            self.store_error = TimeoutError(f"{self.request_id}: {len(not_done)} layer writes still in flight after "
                                            f"{timeout_s:g}s (transfer.timeout_s)")
            return False
        return True

    def _copy_layer_out(self, layer: int, start: int, compute_done: torch.cuda.Event | None) -> None:
        """Copy thread: pages -> staging[start:, layer], once `compute_done` (CUDA) passed."""
        worker = self.worker
        assert worker.copier is not None and worker.kv_pages is not None
        if worker.timeline is not None:
            worker.timeline.record("store", self.request_id, layer, "start")
        if start < self.num_blocks:
            worker.copier.store_layer(worker.kv_pages, layer, self.staging[start:],
                                      self.page_ids[start: self.num_blocks], compute_done).synchronize()

    async def _write_layer_all(self, copy: concurrent.futures.Future[None], layer: int,
                               writes: Sequence[LayerWrite]) -> None:
        timeline = self.worker.timeline
        await asyncio.wrap_future(copy)  # on CUDA the copy waited for layer `layer`'s compute
        await asyncio.gather(*(self.write_layer(w.store_name, w.indices, w.offsets, layer, w.incarnation)
                               for w in writes if w.indices))
        if timeline is not None:
            timeline.record("store", self.request_id, layer, "end")

    async def wait_writes(self, timeout_s: float) -> None:
        """Await every queued layer write; raises the first failure (a failed load included)."""
        writes, self._writes = self._writes, []
        if writes:
            await asyncio.wait_for(asyncio.gather(*(asyncio.wrap_future(w) for w in writes)), timeout_s)
        self.raise_failure()

    async def settle_writes(self, timeout_s: float) -> None:
        """Let in-flight writes end, well or not, so their destinations may be freed without a late write."""
        writes, self._writes = self._writes, []
        if writes:
            await asyncio.wait([asyncio.wrap_future(w) for w in writes], timeout=timeout_s)

    # ---- end -------------------------------------------------------------------------------------------
    async def release(self) -> None:
        """Free pages and staging; idempotent, and safe to cancel (what then still runs ends by its deadline
        before the pages are freed). In-flight writes are cancelled, queued copies awaited."""
        if self._is_released:
            return
        self._is_released = True
        for write in self._writes:
            if write.cancel():
                self._is_moves_clean = False
        self._writes = []
        timeout_s = self.worker.config.transfer.timeout_s
        try:
            is_quiet = await self._settle_copies(timeout_s)
            if self.loader is not None:
                is_quiet = await self.loader.close(timeout_s) and is_quiet
        except asyncio.CancelledError:
            self._give_back(delay_s=timeout_s, is_reusable=False)
            raise
        if not is_quiet:  # a copy still runs: its pages and staging stay taken rather than reused under it
            logger.error("%s: KV copies still running after %gs; its pages and staging are not reused",
                         self.request_id, timeout_s)
            return
        # moves touch staging only (dropped below when one was abandoned), so the pages are free at once
        self._give_back(delay_s=0.0, is_reusable=self._is_moves_clean)

    def _give_back(self, delay_s: float, is_reusable: bool) -> None:
        worker = self.worker
        assert worker.pages is not None and worker.staging_pool is not None
        worker.staging_pool.release(self._buffer, is_reusable=is_reusable)
        if delay_s > 0:
            worker.free_pages_later(self.request_id, delay_s)
        else:
            worker.pages.free_owner(self.request_id)

    async def _settle_copies(self, timeout_s: float) -> bool:
        pending = [c for c in self._copies if not c.cancel() and not c.done()]
        if pending:
            _, still_running = await asyncio.wait([asyncio.wrap_future(c) for c in pending], timeout=timeout_s)
            return not still_running
        return True


__all__ = ["BlockSource", "LayerWrite", "LoadFailed", "RequestKv", "num_blocks_for"]
