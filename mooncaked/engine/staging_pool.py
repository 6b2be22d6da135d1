"""Host staging buffers for KV moves, reused across requests: pinned when the pages live on CUDA.

1. `StagingPool(kv_pages, register, unregister, numa_node, max_free_bytes)`: `register(name, tensor)` makes a
   new buffer a transfer-engine segment (once, for its whole life: RDMA memory registration and page pinning
   are far too slow to repeat per request); `numa_node` is where its pages are allocated (the GPU's node).
2. `acquire(num_blocks)` -> StagingBuffer: the smallest free buffer holding `num_blocks` store objects, or a
   new one with room for a power of two of them.
3. `release(buffer, is_reusable)`: the caller guarantees that no copy or transfer touches it any more when
   `is_reusable`; otherwise (a transfer was abandoned mid-flight) the buffer is unregistered and dropped, so a
   late byte cannot land in the next request's staging. Free buffers beyond `max_free_bytes` are dropped too.
4. `close()` unregisters every buffer.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from typing import Any
from dataclasses import dataclass

import numpy as np
import torch

from mooncaked.engine.kv_copy import staging_view
from mooncaked.engine.kv_pages import KVPages
from mooncaked.runtime.numa import memory_bound_to


@dataclass(frozen=True)
class StagingBuffer:
    name: str  # its transfer-engine segment
    data: torch.Tensor  # flat uint8 [num_blocks * block_nbytes], host memory
    num_blocks: int

    @property
    def array(self) -> np.ndarray:
        return self.data.numpy()


class StagingPool:
    """Owns every staging buffer of one worker and their segment registrations; used from the event loop."""

    def __init__(self, kv_pages: KVPages, name_prefix: str, register: Callable[[str, torch.Tensor], Any],
                 unregister: Callable[[str], None], *, numa_node: int | None = None,
                 max_free_bytes: int | None = None) -> None:
        self.kv_pages = kv_pages
        self.name_prefix = name_prefix
        self._register = register
        self._unregister = unregister
        self.numa_node = numa_node
        self.is_pinned = kv_pages.device.type == "cuda"
        self.max_free_bytes = max_free_bytes if max_free_bytes is not None else kv_pages.buffer.nbytes
        self._serials = itertools.count()
        self._free: list[StagingBuffer] = []
        self._in_use: dict[str, StagingBuffer] = {}

    @property
    def num_buffers(self) -> int:
        return len(self._free) + len(self._in_use)

    def acquire(self, num_blocks: int) -> StagingBuffer:
        fitting = [b for b in self._free if b.num_blocks >= num_blocks]
        if fitting:
            buffer = min(fitting, key=lambda b: b.num_blocks)
            self._free.remove(buffer)
        else:
            buffer = self._allocate(1 << max(num_blocks - 1, 0).bit_length())
        self._in_use[buffer.name] = buffer
        return buffer

    def view(self, buffer: StagingBuffer, num_blocks: int) -> torch.Tensor:
        """[num_blocks, layers, planes, block_size, kv_heads, head_dim] over the buffer's first bytes."""
        return staging_view(buffer.data, self.kv_pages, num_blocks)

    def release(self, buffer: StagingBuffer, is_reusable: bool = True) -> None:
        if self._in_use.pop(buffer.name, None) is None:
            raise ValueError(f"staging buffer {buffer.name} is not in use")
        if not is_reusable:
            self._unregister(buffer.name)
            return
        self._free.append(buffer)
        self._free.sort(key=lambda b: b.num_blocks)
        while self._free and sum(b.data.numel() for b in self._free) > self.max_free_bytes:
            self._unregister(self._free.pop().name)  # the largest goes first

    def close(self) -> None:
        for buffer in [*self._free, *self._in_use.values()]:
            self._unregister(buffer.name)
        self._free.clear()
        self._in_use.clear()

    def _allocate(self, num_blocks: int) -> StagingBuffer:
        num_bytes = num_blocks * self.kv_pages.block_nbytes
        placement = memory_bound_to(self.numa_node) if self.numa_node is not None else contextlib.nullcontext()
        with placement:  # pinning touches every page: they land on the bound node
            data = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=self.is_pinned)
            if not self.is_pinned:
                data.zero_()
        buffer = StagingBuffer(f"{self.name_prefix}/staging/{next(self._serials)}", data, num_blocks)
        self._register(buffer.name, data)
        return buffer
