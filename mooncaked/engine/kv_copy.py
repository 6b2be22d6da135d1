"""Whole-block KV copies between device pages and a staging buffer in the store's object layout.

Layout (DESIGN section 5): staging [N, num_layers, 2, block_size, kv_heads, head_dim]; block n is one store
object, and one layer's slice of it (`staging[n, layer]`, K then V) is one contiguous byte range at
`layer_byte_range(kv_pages, layer)`. Staging may live in host memory (pinned, or a shared-memory pool mapped
as a tensor) or on the device.

1. `KVCopier(device)` owns the copy stream: on CUDA a dedicated stream, so loads and stores overlap compute;
   on CPU copies run synchronously in the caller, with the same API.
2. Load before layer i: `load_layer(kv_pages, layer, staging, page_ids)` -> CopyHandle; the compute side calls
   `handle.wait_on_current_stream()` in `before_layer(i)` (no host block on CUDA).
3. Store after layer i: `store_layer(...)` starts after the compute stream's work so far (an event), and
   `handle.synchronize()` / `handle.is_done()` tell the host when staging holds the bytes to send.
   Staging must not be modified or reused until its handle is done.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from mooncaked import kernels
from mooncaked.engine.kv_pages import KVPages


def staging_shape(kv_pages: KVPages, num_blocks: int) -> tuple[int, ...]:
    return (num_blocks, kv_pages.num_layers, 2, kv_pages.block_size, kv_pages.num_kv_heads, kv_pages.head_dim)


def layer_byte_range(kv_pages: KVPages, layer: int) -> tuple[int, int]:
    """(offset, length) in bytes of one layer's K and V inside one store object."""
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


# work(page_ids int64 [N] on the pages' device), run on the copy stream
_Work = Callable[[torch.Tensor], None]


class CopyHandle:
    """Completion of one submitted copy: an event on CUDA, already complete on CPU."""

    def __init__(self, event: torch.cuda.Event | None) -> None:
        self.event = event

    def is_done(self) -> bool:
        return self.event is None or bool(self.event.query())

    def synchronize(self) -> None:
        """Block the host until the copy finished."""
        if self.event is not None:
            self.event.synchronize()

    def wait_on_current_stream(self) -> None:
        """Make work queued later on the current stream wait for the copy (host does not block)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


class KVCopier:
    """Owns the copy stream for one device; all block copies of a worker go through it in submission order."""

    def __init__(self, device: torch.device | str, backend: str = "auto") -> None:
        self.device = torch.device(device)
        self.backend = backend
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def load_layer(self, kv_pages: KVPages, layer: int, staging: torch.Tensor,
                   page_ids: Sequence[int]) -> CopyHandle:
        """staging[n, layer] -> pages page_ids[n] of `layer`."""
        return self._submit(lambda ids: self._load(kv_pages, layer, staging, ids), kv_pages, staging, page_ids)

    def store_layer(self, kv_pages: KVPages, layer: int, staging: torch.Tensor,
                    page_ids: Sequence[int]) -> CopyHandle:
        """pages page_ids[n] of `layer` -> staging[n, layer]."""
        return self._submit(lambda ids: self._store(kv_pages, layer, staging, ids), kv_pages, staging, page_ids)

    def load_all_layers(self, kv_pages: KVPages, staging: torch.Tensor, page_ids: Sequence[int]) -> CopyHandle:
        def run(ids: torch.Tensor) -> None:
            for layer in range(kv_pages.num_layers):
                self._load(kv_pages, layer, staging, ids)
        return self._submit(run, kv_pages, staging, page_ids)

    def store_all_layers(self, kv_pages: KVPages, staging: torch.Tensor, page_ids: Sequence[int]) -> CopyHandle:
        def run(ids: torch.Tensor) -> None:
            for layer in range(kv_pages.num_layers):
                self._store(kv_pages, layer, staging, ids)
        return self._submit(run, kv_pages, staging, page_ids)

    def _submit(self, work: _Work, kv_pages: KVPages, staging: torch.Tensor, page_ids: Sequence[int]) -> CopyHandle:
        _check_staging(kv_pages, staging, len(page_ids))
        if self.stream is None:
            work(torch.tensor(list(page_ids), dtype=torch.int64, device=kv_pages.device))
            return CopyHandle(None)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)  # copies see every page write queued before this call
            ids = torch.tensor(list(page_ids), dtype=torch.int64).to(self.device, non_blocking=True)
            work(ids)
            done = torch.cuda.Event()
            done.record(self.stream)
        return CopyHandle(done)

    def _load(self, kv_pages: KVPages, layer: int, staging: torch.Tensor, ids: torch.Tensor) -> None:
        if staging.device == kv_pages.device:
            src = staging[:, layer]  # [N, 2, B, Hkv, D]
        else:  # host -> device per block: each source range is contiguous, so the copies stay asynchronous
            src = torch.empty((staging.shape[0], *staging.shape[2:]), dtype=staging.dtype, device=kv_pages.device)
            for n in range(staging.shape[0]):
                src[n].copy_(staging[n, layer], non_blocking=True)
        kernels.scatter_blocks(src[:, 0], kv_pages.k_pages[layer], ids, self.backend)
        kernels.scatter_blocks(src[:, 1], kv_pages.v_pages[layer], ids, self.backend)

    def _store(self, kv_pages: KVPages, layer: int, staging: torch.Tensor, ids: torch.Tensor) -> None:
        k = kernels.gather_blocks(kv_pages.k_pages[layer], ids, self.backend)  # [N, B, Hkv, D]
        v = kernels.gather_blocks(kv_pages.v_pages[layer], ids, self.backend)
        both = torch.stack([k, v], dim=1)  # [N, 2, B, Hkv, D]
        if staging.device == both.device:
            staging[:, layer].copy_(both)
            return
        for n in range(both.shape[0]):  # device -> host per block: each destination range is contiguous
            staging[n, layer].copy_(both[n], non_blocking=True)


def _check_staging(kv_pages: KVPages, staging: torch.Tensor, num_blocks: int) -> None:
    expected = staging_shape(kv_pages, num_blocks)
    if tuple(staging.shape) != expected or staging.dtype != kv_pages.dtype:
        raise ValueError(f"staging must be {kv_pages.dtype} {expected}, got {staging.dtype} {tuple(staging.shape)}")
    if not staging.is_contiguous():
        raise ValueError("staging must be contiguous (the store object layout)")

