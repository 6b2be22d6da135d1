"""One request's KV on a worker: its pages, the staging it holds while moves need it, and its byte moves.

1. `RequestKv(worker, request_id, num_tokens)` allocates pages for every block of the prompt (the partial tail
   included) plus `num_extra_tokens`; `fork` makes a parallel sampling's further sequence, which shares the
   prompt's full-block pages (read-only; freed once the last sequence lets go) and has its own partial tail
   (a copy) and output pages. Given the prompt's `block_keys`, it first reads the longest prefix of its
   first `num_shareable_blocks` the instance's device prefix cache holds in place (`num_device_blocks` of them:
   those pages are shared, read-only, and nothing loads or computes them); `mark_complete()` says the prompt's
   full blocks hold their final KV (`mark_complete_through` a decoded sequence's, output included), and
   `release()` then leaves them in the cache for later requests. Store objects have the pages' layout (docs/design.md section 5). Pages in host
   memory (CPU, one process) are a transfer-engine segment: every move goes straight between them and the stores
   (`is_direct`). A tensor-parallel instance on CPU (worker.tp) moves between its ranks' pages and this host's
   mapped store pool in strided copies on the copy thread (engine/tp_copy.py). Other moves (GPU pages, one
   rank's or many; a tensor-parallel instance with another host's store) go through a staging buffer
   [num_blocks, layers, 2, block_size, kv_heads, head_dim] in the object layout, which the request holds only
   while such a move is in flight (request_memory.StagingHold); the copier copies every rank's heads of it.
2. Loading: `start_loading(sources, num_blocks)` (event loop) starts a LayerLoader, which loads layer by layer
   (`load_layer`: straight into the pages, or into staging and then into the pages on the copy thread; the moves
   themselves are request_moves.py's, RequestKv's base). The forward waits per layer (`wait_layer_loaded`,
   compute thread); a caller that needs all of it awaits `wait_loaded`.
3. Storing: `store_layer(i, writes)` (compute thread, after layer i) queues layer i's writes to every store
   (event loop; staged ones after the copy of layer i of their blocks from the pages into staging on the copy
   thread; GPU pages registered for RDMA (GPUDirect) go to another host's store straight from the pages) and
   returns: layer i is sent while layer i+1 computes. At most `worker.max_layers_in_flight` layers are in
   flight; beyond, the compute thread waits for the oldest. `wait_writes()` awaits them all (and reports a
   failed load). Same-host copies run on the copy thread, others on the transfer engine's threads: none on the
   compute thread.
4. `release()` stops the loader, refuses new copies, waits for running ones (request_memory.CopyTracker), frees
   the pages and gives staging back; the caller owns store handles and leases and ends them (commit, abort,
   release) after it, so no same-host copy touches a pool region once its handle or lease ended. Memory a
   transfer-engine move was abandoned in (cancelled, failed mid-flight) may still take late bytes: staging is
   dropped, not reused, and pages that were a move's end are freed only after transfer.io_timeout_s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Sequence

from mooncaked.engine.kv_pages import KVPages
from mooncaked.engine.tp.copy import RankPagesEnd
from mooncaked.kv.keys import block_keys
from mooncaked.roles.worker.kv.layer_loader import LayerLoader, LoadFailed
from mooncaked.roles.worker.kv.request_moves import RequestMoves
from mooncaked.roles.worker.kv.request_memory import CopyTracker, StagingHold
from mooncaked.roles.worker.kv.spans import StoreBlocks, num_blocks_for
from mooncaked.roles.worker.worker import Worker

logger = logging.getLogger(__name__)


class RequestKv(RequestMoves):
    """Owns one request's pages, its copies (CopyTracker), its staging while moves need it (StagingHold), its
    loader and its in-flight writes."""

    def __init__(self, worker: Worker, request_id: str, num_tokens: int, num_extra_tokens: int = 0,
                 reserved_by: str = "", block_keys: Sequence[bytes] = (), num_shareable_blocks: int = 0,
                 shares_prompt_of: RequestKv | None = None) -> None:
        """`reserved_by`: the owner holding pages set aside for this request (a decode reservation's): they become
        this request's, and only the rest are allocated. `block_keys`: the prompt's (checked), for the device
        prefix cache; at most `num_shareable_blocks` leading blocks are read from it. `shares_prompt_of`: a
        parallel sampling's first sequence, of the same prompt, whose full prompt blocks this one reads in place
        (see fork)."""
        assert worker.pages is not None and worker.kv_pages is not None and worker.staging_pool is not None
        self.worker = worker
        self.kv_pages: KVPages = worker.kv_pages  # the worker's
        self.request_id = request_id
        self.num_tokens = num_tokens
        self.num_blocks = num_blocks_for(num_tokens, worker.block_size)
        self.num_full_blocks = num_tokens // worker.block_size
        assert not block_keys or len(block_keys) == self.num_full_blocks, "one key per full block of the prompt"
        self.block_keys = list(block_keys)
        self.num_complete_blocks = 0  # leading full blocks whose KV is final (mark_complete)
        num_pages = num_blocks_for(num_tokens + num_extra_tokens, worker.block_size)
        if shares_prompt_of is None:
            shared = worker.pages.share_prefix(self.block_keys[:num_shareable_blocks], request_id)
            self.num_device_blocks = len(shared)
        else:  # the prompt's full blocks, read in place; the partial tail gets a page of its own (fork)
            shared = shares_prompt_of.page_ids[: self.num_full_blocks]
            worker.pages.share(shared, shares_prompt_of.request_id, request_id)
            self.num_device_blocks = 0
        # pages this request holds together with its parallel sampling's other sequences (their prompt's full
        # blocks; 0 alone): counted once for them all
        self.num_sibling_pages = 0 if shares_prompt_of is None else len(shared)
        num_own = num_pages - len(shared)
        reserved = worker.pages.transfer(reserved_by, request_id, num_own) if reserved_by else []
        try:
            more = worker.pages.allocate(max(num_own - len(reserved), 0), owner=request_id)
        except BaseException:
            worker.pages.free_owner(request_id)
            raise
        self.page_ids: list[int] = shared + reserved + more
        self.is_direct = worker.host_pages is not None  # every move straight between the pages and the stores
        is_ranks_mapped = worker.tp is not None and self.kv_pages.device.type == "cpu"
        self.ranks_end = RankPagesEnd(self.kv_pages, self.page_ids) if is_ranks_mapped else None
        self.staging = StagingHold(worker.staging_pool, self.num_blocks)
        self.copies = CopyTracker(worker.copy_thread, request_id)
        self.num_loaded = 0
        self.loader: LayerLoader | None = None
        self.store_error: Exception | None = None
        self._writes: list[concurrent.futures.Future[None]] = []
        self._is_moves_clean = True  # no move straight into or out of the pages was abandoned mid-flight
        self._is_released = False
        self.is_settled = True  # see release

    def fork(self, request_id: str, num_extra_tokens: int, reserved_by: str = "") -> RequestKv:
        """A parallel sampling's further sequence of this prompt (whose KV is complete): it holds the prompt's full
        blocks' pages together with this one (read-only: a sequence writes only past its prompt), and pages of its
        own for the partial last block and `num_extra_tokens`; the caller copies the partial block's page
        (`tail_copy`) before the sequence's first step writes it."""
        child = RequestKv(self.worker, request_id, self.num_tokens, num_extra_tokens, reserved_by=reserved_by,
                          shares_prompt_of=self)
        self.num_sibling_pages = child.num_sibling_pages
        return child

    def tail_copy(self, child: RequestKv) -> tuple[list[int], list[int]]:
        """(source pages, target pages) that give `child` (a fork) its copy of the prompt's partial last block."""
        if self.num_full_blocks == self.num_blocks:
            return [], []
        return [self.page_ids[self.num_full_blocks]], [child.page_ids[self.num_full_blocks]]

    # ---- loading ---------------------------------------------------------------------------------------
    def start_loading(self, sources: Sequence[StoreBlocks], num_blocks: int) -> None:
        """Event loop: load blocks [0, num_blocks) of every layer from `sources` into the pages."""
        self.num_loaded = num_blocks
        if num_blocks:
            self.loader = LayerLoader(self, sources)
            self.loader.start()

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
    def store_layer(self, layer: int, writes: Sequence[StoreBlocks]) -> None:
        """Compute thread, right after layer `layer` was computed (queued, on CUDA): see stage 3."""
        if self.is_failed or not self._wait_store_window():
            return
        worker = self.worker
        assert worker.copier is not None
        compute_done = worker.copier.mark_compute()  # layer `layer`'s end: a copy waits for nothing later
        self._writes.append(worker.post(self._store_layer_all(layer, writes, compute_done)))

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
    def mark_complete(self) -> None:
        """The prompt's full blocks hold their final KV (computed, or loaded whole): release() may cache them."""
        self.num_complete_blocks = self.num_full_blocks

    def mark_complete_through(self, token_ids: Sequence[int], namespace: bytes) -> None:
        """A sequence's tokens whose KV is in the pages (its prompt, then its output but the last token, whose KV
        no step wrote): release() may cache all their full blocks, output ones included, under their keys in
        `namespace` (the request's isolated one)."""
        keys = block_keys(token_ids, self.worker.block_size, namespace)
        if keys[: len(self.block_keys)] == self.block_keys and len(keys) <= len(self.page_ids):
            self.block_keys, self.num_complete_blocks = keys, len(keys)

    async def release(self) -> None:
        """Free pages and staging; idempotent, and safe to cancel (what then still runs ends by its deadline
        before the pages are freed). In-flight writes are cancelled, running copies awaited; no copy starts
        after this began. `is_settled` is then False only when a copy still ran past transfer.timeout_s: the
        pool regions it touches must then not be freed (the caller leaves them to their leases)."""
        if self._is_released:
            return
        self._is_released = True
        self.copies.close()
        self.staging.close()
        for write in self._writes:
            if write.cancel():
                self.staging.is_clean = False
                if self.is_direct:  # its transfer may still write the pages
                    self._is_moves_clean = False
        self._writes = []
        timeout_s = self.worker.config.transfer.timeout_s
        try:
            if self.loader is not None:
                await self.loader.close()
            self.is_settled = await self.copies.settle(timeout_s)
        except asyncio.CancelledError:
            self._give_back(delay_s=timeout_s, is_reusable=False)
            raise
        if not self.is_settled:  # a copy still runs: its pages and staging stay taken rather than reused under it
            logger.error("%s: KV copies still running after %gs; its pages and staging are not reused",
                         self.request_id, timeout_s)
            return
        # moves through staging and copies on the copy thread (settled above) never write the pages late
        is_late_write_possible = not self._is_moves_clean
        self._give_back(delay_s=self.worker.config.transfer.io_timeout_s if is_late_write_possible else 0.0,
                        is_reusable=True)

    def _give_back(self, delay_s: float, is_reusable: bool) -> None:
        worker = self.worker
        assert worker.pages is not None
        self.staging.give_back(is_reusable and self.staging.num_users == 0)
        if delay_s > 0:
            worker.free_pages_later(self.request_id, delay_s)
            return
        if is_reusable and self.block_keys and self.num_complete_blocks:
            num = self.num_complete_blocks
            worker.pages.keep(self.request_id, list(zip(self.block_keys[:num], self.page_ids[:num])))
        worker.pages.free_owner(self.request_id)


__all__ = ["LoadFailed", "RequestKv"]
