"""Layer-wise loading of one request's blocks from stores into its pages (a reused prefix, a prefilled prompt).

1. `LayerLoader(kv, sources)`; `start()` (event loop) starts its task.
2. The task walks the layers in order with at most `worker.max_layers_in_flight` of them in flight: for layer i
   it has the request load layer i's slice of every source block (`load_layer`: one move per store, straight
   into host pages, or through staging and then a copy into the pages); layer i is then ready. Layer i+1's load
   is already under way while layer i computes.
3. The compute thread calls `wait_layer(i)` before layer i (it returns False once the loading failed: the caller
   stops using this request); an event-loop caller awaits `wait_all()`.
4. `close()` cancels what is left; the request waits for copies still running (request_memory.CopyTracker).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from typing import Protocol

from mooncaked.roles.worker.kv.spans import StoreBlocks
from mooncaked.roles.worker.messages import REASON_KV_LOAD_FAILED
from mooncaked.roles.worker.worker import Worker
from mooncaked.rpc import Unavailable

logger = logging.getLogger(__name__)


class LoadTarget(Protocol):
    """What the loader uses of a request's KV (request_kv.RequestKv, which owns the loader)."""

    request_id: str
    worker: Worker

    async def load_layer(self, layer: int, sources: Sequence[StoreBlocks]) -> None: ...


class LoadFailed(Unavailable):
    """Loading a request's KV failed or ran past its deadline (a store that stopped answering, say); the message
    starts with REASON_KV_LOAD_FAILED and says from which stores, which layer and why. Its blocks were never
    marked ready, so nothing computed on them."""


class LayerLoader:
    """Owns the loading task of one request, its per-layer readiness and the copies it queued."""

    def __init__(self, kv: LoadTarget, sources: Sequence[StoreBlocks]) -> None:
        self.kv = kv
        self.sources = [s for s in sources if s.block_indices]
        worker = kv.worker
        assert worker.kv_pages is not None
        self.num_layers = worker.kv_pages.num_layers
        self._ready = [threading.Event() for _ in range(self.num_layers)]
        self.error: LoadFailed | None = None
        self.load_s = 0.0  # from start() to the last layer loaded (0 until then, and after a failure)
        self._started_at = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._started_at = time.monotonic()
        self._task = asyncio.create_task(self._run(), name=f"load-{self.kv.request_id}")

    @property
    def is_done(self) -> bool:
        return self._ready[-1].is_set() if self._ready else True

    def wait_layer(self, layer: int, timeout_s: float) -> bool:
        """Compute thread: block until layer `layer` is in the pages; False when the loading failed."""
        if not self._ready[layer].wait(timeout_s):
            self._fail(f"layer {layer} was not loaded within {timeout_s:g}s (worker.kv_load_timeout_s)")
        return self.error is None

    async def wait_all(self, timeout_s: float) -> None:
        """Event loop: return once every layer is in the pages; LoadFailed otherwise."""
        assert self._task is not None
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
        except asyncio.TimeoutError:
            self._fail(f"the KV was not loaded within {timeout_s:g}s (worker.kv_load_timeout_s)")
        if self.error is not None:
            raise self.error

    async def close(self) -> None:
        """Cancel the task (the request's CopyTracker then waits for copies still running). Awaits nothing when
        the task is done (a caller being cancelled then still gets its pages back at once)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def _fail(self, message: str) -> None:
        if self.error is None:
            stores = ", ".join(sorted({source.store_name for source in self.sources}))
            self.error = LoadFailed(f"{REASON_KV_LOAD_FAILED}: loading the KV of {self.kv.request_id} from "
                                    f"store {stores}: {message}")
            logger.warning("%s", self.error)
        for ready in self._ready:
            ready.set()

    async def _run(self) -> None:
        slots = asyncio.Semaphore(self.kv.worker.section.max_layers_in_flight)
        layers: list[asyncio.Task[None]] = []
        try:
            for layer in range(self.num_layers):
                await slots.acquire()
                if self.error is not None:
                    break
                layers.append(asyncio.create_task(self._load_layer(layer, slots)))
            await asyncio.gather(*layers)
            if self.error is None:
                self.load_s = time.monotonic() - self._started_at
        finally:
            for task in layers:
                task.cancel()
            await asyncio.gather(*layers, return_exceptions=True)

    async def _load_layer(self, layer: int, slots: asyncio.Semaphore) -> None:
        kv, timeline = self.kv, self.kv.worker.timeline
        try:
            if timeline is not None:
                timeline.record("load", kv.request_id, layer, "start")
            await kv.load_layer(layer, self.sources)
            if timeline is not None:
                timeline.record("load", kv.request_id, layer, "end")
            self._ready[layer].set()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._fail(f"layer {layer}: {type(exc).__name__}: {exc}")
        finally:
            slots.release()
