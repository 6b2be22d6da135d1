"""What one request's moves use besides its pages: its copies on the copy thread, and staging while it needs it.

1. `CopyTracker(copy_thread)` is the executor a request's copies run on (page <-> staging copies, and same-host
   moves given to StoreClient.move): it keeps each submitted future, so `settle(timeout_s)` can wait until no
   copy touches the pages, the staging or a pool region any more. After `close()` it refuses new copies
   (CancelledError), so a move resumed after its request was released never starts a copy.
2. `StagingHold(pool, num_blocks)` lends the request a staging buffer only while moves through staging are in
   flight: `async with hold:` around each such move (a layer's load from, or store to, another host's store)
   acquires the buffer on first use and gives it back when the last one ends; a move that ended in an error or a
   cancellation marks the buffer dirty, so it is dropped, not reused (a late byte could still land in it).
   Used from the event loop only. `index_runs` turns the block indices a move stages into runs of rows, which
   `copy_staging` copies between staging and the pages on the copy thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import torch

from mooncaked.engine.kv_copy import KVCopier
from mooncaked.engine.kv_pages import KVPages
from mooncaked.engine.staging_pool import StagingBuffer, StagingPool
from mooncaked.transfer import TransferOp


class CopyTracker(concurrent.futures.Executor):
    """Owns the futures of one request's copies; the copy thread belongs to the worker."""

    def __init__(self, copy_thread: concurrent.futures.Executor, request_id: str) -> None:
        self.copy_thread = copy_thread
        self.request_id = request_id
        self.is_closed = False
        self._futures: list[concurrent.futures.Future[Any]] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        if self.is_closed:
            raise asyncio.CancelledError(f"{self.request_id} was released: no copy starts for it any more")
        self._futures = [f for f in self._futures if not f.done()]
        future = self.copy_thread.submit(fn, *args, **kwargs)
        self._futures.append(future)
        return future

    def close(self) -> None:
        self.is_closed = True

    async def settle(self, timeout_s: float) -> bool:
        """Cancel copies not started; wait for the running ones. False when one still runs after `timeout_s`.
        Awaits nothing when nothing runs."""
        pending = [f for f in self._futures if not f.cancel() and not f.done()]
        if not pending:
            return True
        _, still_running = await asyncio.wait([asyncio.wrap_future(f) for f in pending], timeout=timeout_s)
        return not still_running


class StagingHold:
    """Owns the staging buffer one request holds while it has moves through staging in flight."""

    def __init__(self, pool: StagingPool, num_blocks: int) -> None:
        self.pool = pool
        self.num_blocks = num_blocks
        self.buffer: StagingBuffer | None = None
        self.view: torch.Tensor | None = None  # [num_blocks, layers, planes, block_size, kv_heads, head_dim]
        self.is_clean = True  # no move through the current buffer was abandoned
        self.is_closed = False
        self.num_users = 0

    def close(self) -> None:
        """The request was released: no move takes staging any more."""
        self.is_closed = True

    async def __aenter__(self) -> tuple[StagingBuffer, torch.Tensor]:
        """(the buffer, its view): what a move and its copies use, passed on rather than read later."""
        if self.is_closed:
            raise asyncio.CancelledError("the request was released: no move takes staging for it any more")
        if self.buffer is None:
            self.buffer = self.pool.acquire(self.num_blocks)
            self.view = self.pool.view(self.buffer, self.num_blocks)
            self.is_clean = True
        self.num_users += 1
        assert self.buffer is not None and self.view is not None
        return self.buffer, self.view

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        traceback: TracebackType | None) -> None:
        if error is not None:
            self.is_clean = False
        self.num_users -= 1
        if self.num_users == 0:
            self.give_back(self.is_clean)

    def give_back(self, is_reusable: bool) -> None:
        """Return the buffer now (release: whatever still holds it), dropped unless `is_reusable`."""
        if self.buffer is not None:
            self.pool.release(self.buffer, is_reusable=is_reusable and self.is_clean)
            self.buffer, self.view = None, None


def index_runs(indices: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted block indices as runs [start, stop) of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for index in indices:
        if runs and runs[-1][1] == index:
            runs[-1] = (runs[-1][0], index + 1)
        else:
            runs.append((index, index + 1))
    return runs


def copy_staging(copier: KVCopier, kv_pages: KVPages, page_ids: Sequence[int], op: TransferOp, layer: int,
                 runs: Sequence[tuple[int, int]], view: torch.Tensor, compute_done: torch.cuda.Event | None) -> None:
    """Copy thread. READ: staging rows of each run [start, stop) of `layer` -> their pages; WRITE: the reverse,
    once `compute_done` (CUDA) passed."""
    for start, stop in runs:
        rows, ids = view[start:stop], page_ids[start:stop]
        handle = (copier.load_layer(kv_pages, layer, rows, ids) if op is TransferOp.READ
                  else copier.store_layer(kv_pages, layer, rows, ids, compute_done))
        handle.synchronize()


__all__ = ["CopyTracker", "StagingHold", "copy_staging", "index_runs"]
