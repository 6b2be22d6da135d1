"""Whole-block KV copies between device pages and a staging buffer in the store's object layout.

Layout (docs/design.md section 5): staging [N, num_layers, planes, block_size, model's kv_heads, head_dim] (planes: K
and V, or one MLA latent); block n is one store object, and one layer's slice of it (`staging[n, layer]`, its
planes in order) is one contiguous byte range at
`layer_byte_range(kv_pages, layer)`. Staging may live in host memory (pinned, or a shared-memory pool mapped
as a tensor) or on the device.

1. `KVCopier(device)` owns a copy stream per CUDA device. Submitting a copy never runs it on the caller's
   thread, and copies every part of the pages (`KVPages.copy_parts`: the pages themselves, or each rank's of a
   tensor-parallel instance, whose heads are a slice of the staging row's):
   - CUDA: the copy is queued on the copy stream of the part's device and the handle holds an event recorded
     after it (one per part).
     A store of layer i first waits for one event recorded on the compute stream at submission (right after
     layer i's kernels were queued): it waits for layer i's compute and for nothing queued later. A load waits
     for no compute at all: it fills pages of a request that no queued kernel touches yet.
   - CPU: the handle holds the copy itself; the first `synchronize()` runs it (the worker's copy thread).
2. Load before layer i: `load_layer(kv_pages, layer, staging, page_ids)` -> CopyHandle; once synchronized the
   compute side may run layer i (`wait_on_current_stream()` orders the compute stream after it on CUDA).
3. Store after layer i: the compute thread marks layer i's end (`mark_compute()`), the copy thread submits
   `store_layer(..., compute_done)` -> CopyHandle and `synchronize()`s it: staging then holds the bytes.
   Staging must not be modified or reused until its handle is done.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence

import torch

from mooncaked import kernels
from mooncaked.engine.kv_pages import KVPages


def staging_shape(kv_pages: KVPages, num_blocks: int) -> tuple[int, ...]:
    """Staging rows hold every KV head of the model (a rank's pages copy their heads' slice of them)."""
    return (num_blocks, kv_pages.num_layers, kv_pages.num_planes, kv_pages.block_size, kv_pages.num_model_kv_heads,
            kv_pages.row_width)


def layer_byte_range(kv_pages: KVPages, layer: int) -> tuple[int, int]:
    """(offset, length) in bytes of one layer's planes inside one store object."""
    if not 0 <= layer < kv_pages.num_layers:
        raise ValueError(f"layer {layer} out of range [0, {kv_pages.num_layers})")
    return layer * kv_pages.layer_block_nbytes, kv_pages.layer_block_nbytes


def staging_view(buffer: torch.Tensor, kv_pages: KVPages, num_blocks: int) -> torch.Tensor:
    """View a flat byte buffer (uint8, e.g. a mapped store region) as staging for `num_blocks` objects."""
    needed = num_blocks * kv_pages.block_nbytes
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < needed:
        raise ValueError(f"staging buffer must be flat uint8 of >= {needed} bytes; got {buffer.dtype} "
                         f"{tuple(buffer.shape)}")
    return buffer[:needed].view(kv_pages.dtype).view(staging_shape(kv_pages, num_blocks))


def new_staging(kv_pages: KVPages, num_blocks: int, device: torch.device | str = "cpu") -> torch.Tensor:
    pin = torch.device(device).type == "cpu" and kv_pages.device.type == "cuda"
    return torch.empty(staging_shape(kv_pages, num_blocks), dtype=kv_pages.dtype, device=device, pin_memory=pin)


# work(pages, page_ids int64 [N] on the pages' device): the copy of one part, on a copy stream or the copy thread
_Work = Callable[[KVPages, torch.Tensor], None]


class CopyHandle:
    """Completion of one submitted copy: events on CUDA (one per device copied to or from); on CPU the copy
    itself, run once by `synchronize`."""

    def __init__(self, events: Sequence[torch.cuda.Event] = (), work: Callable[[], None] | None = None) -> None:
        self.events = list(events)
        self._work = work
        self._lock = threading.Lock()

    def is_done(self) -> bool:
        if self.events:
            return all(bool(event.query()) for event in self.events)
        return self._work is None

    def synchronize(self) -> None:
        """Block until the copy finished; on CPU run it here unless another thread did (or is doing) so."""
        for event in self.events:
            event.synchronize()
        with self._lock:
            if self._work is None:
                return
            try:
                with torch.no_grad():
                    self._work()
            finally:
                self._work = None

    def wait_on_current_stream(self) -> None:
        """Order work queued later on the current stream after the copy (CUDA: no host block)."""
        if not self.events:
            self.synchronize()
        for event in self.events:
            torch.cuda.current_stream().wait_event(event)


class KVCopier:
    """Owns the copy streams, one per CUDA device it copies on (a tensor-parallel instance's ranks' devices);
    the block copies of a worker go through them in submission order."""

    def __init__(self, device: torch.device | str, backend: str = "auto") -> None:
        self.device = torch.device(device)
        self.backend = backend
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def load_layer(self, kv_pages: KVPages, layer: int, staging: torch.Tensor,
                   page_ids: Sequence[int]) -> CopyHandle:
        """staging[n, layer] -> pages page_ids[n] of `layer`."""
        return self._submit(functools.partial(self._load, layer, staging), kv_pages, staging, page_ids,
                            is_store=False)

    def mark_compute(self) -> torch.cuda.Event | None:
        """An event after the compute queued so far on this thread's current stream (CUDA; None on CPU): the
        compute thread marks layer i's end with it, and a store submitted later from another thread waits on it."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def store_layer(self, kv_pages: KVPages, layer: int, staging: torch.Tensor, page_ids: Sequence[int],
                    compute_done: torch.cuda.Event | None = None) -> CopyHandle:
        """pages page_ids[n] of `layer` -> staging[n, layer], after `compute_done` (`mark_compute()` of the
        compute thread after layer `layer`), else after the compute queued so far on this thread's stream."""
        return self._submit(functools.partial(self._store, layer, staging), kv_pages, staging, page_ids,
                            is_store=True, compute_done=compute_done)

    def load_all_layers(self, kv_pages: KVPages, staging: torch.Tensor, page_ids: Sequence[int]) -> CopyHandle:
        def run(pages: KVPages, ids: torch.Tensor) -> None:
            for layer in range(pages.num_layers):
                self._load(layer, staging, pages, ids)
        return self._submit(run, kv_pages, staging, page_ids, is_store=False)

    def store_all_layers(self, kv_pages: KVPages, staging: torch.Tensor, page_ids: Sequence[int]) -> CopyHandle:
        def run(pages: KVPages, ids: torch.Tensor) -> None:
            for layer in range(pages.num_layers):
                self._store(layer, staging, pages, ids)
        return self._submit(run, kv_pages, staging, page_ids, is_store=True)

    def _submit(self, work: _Work, kv_pages: KVPages, staging: torch.Tensor, page_ids: Sequence[int], *,
                is_store: bool, compute_done: torch.cuda.Event | None = None) -> CopyHandle:
        """`work` for each part of `kv_pages` (every rank's pages of a tensor-parallel instance): loads fill every
        part, a replica of a KV head included; stores read each KV head from the first part holding it."""
        _check_staging(kv_pages, staging, len(page_ids))
        parts = [pages for pages, _, is_writer in kv_pages.copy_parts() if is_writer or not is_store]
        if kv_pages.device.type != "cuda":
            ids = torch.tensor(list(page_ids), dtype=torch.int64)
            return CopyHandle(work=functools.partial(_run_parts, work, parts, ids))
        if is_store and compute_done is None:
            compute_done = self.mark_compute()
        return CopyHandle(events=[self._queue(work, pages, page_ids, compute_done) for pages in parts])

    def stream_for(self, device: torch.device) -> torch.cuda.Stream:
        """The copy stream of CUDA `device` (created on first use)."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def _queue(self, work: _Work, pages: KVPages, page_ids: Sequence[int],
               compute_done: torch.cuda.Event | None) -> torch.cuda.Event:
        """Queue `work` on the copy stream of `pages`' device, after `compute_done` (an event of the compute
        stream of rank 0's device: another rank's layer i is written once rank 0's layer i, whose all-reduces join
        it, is done)."""
        stream = self.stream_for(pages.device)
        with torch.cuda.stream(stream):
            if compute_done is not None:
                stream.wait_event(compute_done)
            # a small synchronous copy on the copy stream: a pinned allocation here could serialize the streams
            work(pages, torch.tensor(list(page_ids), dtype=torch.int64, device=pages.device))
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def _load(self, layer: int, staging: torch.Tensor, pages: KVPages, ids: torch.Tensor) -> None:
        heads = _heads(pages, staging)
        if staging.device == pages.device:
            src = staging[:, layer, :, :, heads]  # [N, planes, B, Hp, D]
        elif heads == slice(None):  # host -> device per block: each source range is contiguous, so the copies
            src = torch.empty((staging.shape[0], *staging.shape[2:]), dtype=staging.dtype, device=pages.device)
            for n in range(staging.shape[0]):  # stay asynchronous
                src[n].copy_(staging[n, layer], non_blocking=True)
        else:  # a rank's heads of each block: gathered on the host, then one copy
            src = staging[:, layer, :, :, heads].contiguous().to(pages.device)
        for plane, plane_pages in enumerate(pages.plane_pages):
            kernels.scatter_blocks(src[:, plane], plane_pages[layer], ids, self.backend)

    def _store(self, layer: int, staging: torch.Tensor, pages: KVPages, ids: torch.Tensor) -> None:
        heads = _heads(pages, staging)
        planes = [kernels.gather_blocks(plane_pages[layer], ids, self.backend)  # [N, B, Hp, D] each
                  for plane_pages in pages.plane_pages]
        if staging.device == planes[0].device:
            for plane, blocks in enumerate(planes):
                staging[:, layer, plane, :, heads].copy_(blocks)
            return
        every = torch.stack(planes, dim=1)  # [N, planes, B, Hp, D]
        if heads != slice(None):  # a rank's heads: one copy to the host, then into each block's head columns
            staging[:, layer, :, :, heads].copy_(every.cpu())
            return
        for n in range(every.shape[0]):  # device -> host per block: each destination range is contiguous
            staging[n, layer].copy_(every[n], non_blocking=True)


def _run_parts(work: _Work, parts: Sequence[KVPages], ids: torch.Tensor) -> None:
    for pages in parts:
        work(pages, ids)


def _heads(pages: KVPages, staging: torch.Tensor) -> slice:
    """The KV heads of `pages` among staging's (every KV head of the model): all, or a tensor-parallel rank's."""
    if pages.num_kv_heads == pages.num_model_kv_heads:
        return slice(None)
    return slice(pages.kv_head_offset, pages.kv_head_offset + pages.num_kv_heads)


def _check_staging(kv_pages: KVPages, staging: torch.Tensor, num_blocks: int) -> None:
    expected = staging_shape(kv_pages, num_blocks)
    if tuple(staging.shape) != expected or staging.dtype != kv_pages.dtype:
        raise ValueError(f"staging must be {kv_pages.dtype} {expected}, got {staging.dtype} {tuple(staging.shape)}")
    if not staging.is_contiguous():
        raise ValueError("staging must be contiguous (the store object layout)")
