"""KV pages of a tensor-parallel worker instance: each rank's pages mapped in rank 0, and all of them as one.

1. CPU: rank 0 (the worker's process) creates one memfd per other rank, `SharedPages.create(nbytes)`, sized by
   `KVPages.nbytes_for` for that rank's KV heads, and passes its fd over the rank's channel (engine.tp.runner);
   the rank maps it (`SharedPages.attach(fd, nbytes)`) and allocates its `KVPages` in it.
   CUDA: a rank allocates its pages on its own device and sends a CUDA IPC handle of them with its "ready"
   (`export_device_pages`); rank 0 opens it (`import_device_pages`) in a context of its own on that device.
   Either way rank 0 sees every rank's pages.
2. `ShardedPages(ranks, args)` is the instance's side of store moves: objects (and staging rows) hold every KV
   head of the model, and each rank's heads are copied between them and that rank's pages (`copy_parts`;
   engine/tp_copy.py for host pages and a mapped pool, engine/kv_copy.py for staging rows): loads fill every
   rank's pages, a replicated KV head included; stores read the first rank of each replica set only. Rank 0
   moves all the instance's bytes; the ranks never talk to a store.
3. `close()` unmaps; a rank's pages live as long as its process and rank 0's mapping.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

import torch
from torch.multiprocessing.reductions import reduce_tensor

from mooncaked.engine.kv_pages import KVPages
from mooncaked.model.config import ModelArgs


class SharedPages:
    """Owns one shared mapping (and, in rank 0, its fd until it is passed on)."""

    def __init__(self, fd: int, nbytes: int) -> None:
        self.fd = fd
        self.nbytes = nbytes
        self._map = mmap.mmap(fd, nbytes)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)  # flat uint8 [nbytes]

    @classmethod
    def create(cls, nbytes: int, name: str) -> SharedPages:
        fd = os.memfd_create(name)
        try:
            os.ftruncate(fd, nbytes)
            return cls(fd, nbytes)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int, nbytes: int) -> SharedPages:
        """Map a received fd (then closed: the mapping keeps the memory)."""
        try:
            return cls(fd, nbytes)
        finally:
            os.close(fd)

    def close(self) -> None:
        del self.tensor
        try:
            self._map.close()
        except BufferError:  # views of the pages (a worker's ShardedPages) still exist: freed with the last one
            pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def forget_fd(self) -> None:
        """The fd was closed elsewhere (attach) or passed on and is no longer needed here."""
        os.close(self.fd)
        self.fd = -1


def export_device_pages(buffer: torch.Tensor) -> tuple[Any, ...]:
    """A rank's CUDA pages as a picklable IPC handle (flat uint8); the rank keeps them alive while it runs."""
    assert buffer.device.type == "cuda", "host pages are shared through memfds (SharedPages)"
    return reduce_tensor(buffer.view(-1).view(torch.uint8))


def import_device_pages(handle: tuple[Any, ...]) -> torch.Tensor:
    """Rank 0: open a rank's exported CUDA pages (flat uint8 on the rank's device)."""
    rebuild, args = handle
    tensor: torch.Tensor = rebuild(*args)
    return tensor


class ShardedPages(KVPages):
    """Every rank's pages of one tensor-parallel instance, as one set of pages for store moves; owns nothing
    (rank 0's pages belong to its runner, the others' mappings to the runner). num_kv_heads is the model's."""

    def __init__(self, ranks: list[KVPages], args: ModelArgs) -> None:  # noqa: super().__init__ would allocate
        first = ranks[0]
        self.ranks = ranks
        self.num_layers, self.first_layer, self.num_model_layers = (first.num_layers, first.first_layer,
                                                                    first.num_model_layers)
        self.num_pages, self.block_size, self.head_dim = first.num_pages, first.block_size, first.head_dim
        self.cache_dtype, self.row_width, self.model_dtype = first.cache_dtype, first.row_width, first.model_dtype
        self.num_planes = first.num_planes
        self.num_kv_heads = self.num_model_kv_heads = args.num_kv_heads
        self.kv_head_offset = 0
        self.dtype, self.device = first.dtype, first.device
        self.buffer = first.buffer
        self.k_pages, self.v_pages, self.plane_pages = [], [], []  # per rank: see copy_parts
        seen: set[int] = set()
        self._parts: list[tuple[KVPages, int, bool]] = []
        for pages in ranks:  # the first rank holding a KV head writes it to the store
            self._parts.append((pages, pages.kv_head_offset, pages.kv_head_offset not in seen))
            seen.add(pages.kv_head_offset)

    def copy_parts(self) -> list[tuple[KVPages, int, bool]]:
        return list(self._parts)
