"""Moves between host KV pages and a mapped store pool with no staging: one transposing copy per page.

1. `PagesEnd(kv_pages, page_ids)` is the local end of one request's moves to and from the store on this host
   (kv/client.py maps its pool): it takes the same spans a staging buffer would (`Span.staging_offset` is an
   offset in staging rows [N, layers, 2, kv_heads, block_size, head_dim], row n for the page `page_ids[n]`), so
   a move names its bytes the same way whichever end it has.
2. `copy_spans(pool, op, spans)` (run on the worker's copy thread by StoreClient.move) copies each span's
   heads between the pool, viewed as [heads, block_size, head_dim] (objects are head-major), and the pages
   [block_size, heads, head_dim] (token-major), for every part of the pages (`KVPages.copy_parts`: a
   tensor-parallel instance's ranks): a READ fills every rank holding a head, a WRITE reads the first only.
   `copy_rows` is the same copy between the pages and host staging rows (moves with another host's store):
   numpy over same-size integers costs a fraction of torch's per-page calls.
3. `page_segment_spans(...)`: pages holding one KV head are the object's bytes already (a page [B, 1, D] is
   [1, B, D]), so another host's store can read a layer straight from the pages registered as a segment
   (GPUDirect, roles/worker/kv_placement.register_kv_pages): K and V are one range each.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from mooncaked.engine.kv_pages import KVPages
from mooncaked.kv.client import Span
from mooncaked.rdma import TransferOp


_SAME_SIZE_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class PagesEnd:
    """One request's view of the host pages as the local end of same-host store moves; owns nothing."""

    def __init__(self, kv_pages: KVPages, page_ids: Sequence[int]) -> None:
        assert kv_pages.device.type == "cpu", "only host pages can be copied to and from a mapped pool"
        self.kv_pages = kv_pages
        self.page_ids = list(page_ids)
        self.head_nbytes = kv_pages.block_size * kv_pages.head_dim * kv_pages.dtype.itemsize
        self.parts = kv_pages.copy_parts()
        # numpy copies bytes as integers of the element size (bfloat16 too): a fraction of torch's per-call cost
        self.int_dtype = _SAME_SIZE_INTS[kv_pages.dtype.itemsize]
        self.arrays = [part.buffer.view(self.int_dtype).numpy() for part, _, _ in self.parts]  # [L, 2, P, B, Hl, D]
        self.is_whole = len(self.parts) == 1 and self.parts[0][0].num_kv_heads == kv_pages.num_kv_heads

    def copy_spans(self, pool: np.ndarray, op: TransferOp, spans: Sequence[Span]) -> None:
        """READ: pool -> pages; WRITE: pages -> pool. `pool` is the flat uint8 mapping of the store's pool."""
        for span in spans:
            self._check(span, pool.nbytes)
            region = pool[span.pool_offset: span.pool_offset + span.num_bytes].view(self.arrays[0].dtype)
            self._copy_span(region, op, span)

    def copy_rows(self, staging: np.ndarray, op: TransferOp, layer: int, rows: Sequence[int]) -> None:
        """READ: staging rows' `layer` -> their pages; WRITE: the reverse. `staging` is the flat uint8 buffer
        [rows, layers, 2, kv_heads, block_size, head_dim]: the same copy as with a pool, at the row offsets."""
        row_nbytes, parts = self.kv_pages.block_nbytes, self.kv_pages.object_spans(layer)
        self.copy_spans(staging, op, [Span(row * row_nbytes + in_row, row * row_nbytes + in_row, size)
                                      for row in rows for _, in_row, size in parts])

    def _check(self, span: Span, pool_nbytes: int) -> None:
        if span.pool_offset < 0 or span.pool_offset + span.num_bytes > pool_nbytes:
            raise ValueError(f"pool range [{span.pool_offset}, +{span.num_bytes}) is outside the pool")
        if span.staging_offset % self.head_nbytes or span.num_bytes % self.head_nbytes:
            raise ValueError(f"span at row offset {span.staging_offset} of {span.num_bytes} bytes is not whole "
                             f"KV heads of {self.head_nbytes} bytes")
        row = span.staging_offset // self.kv_pages.block_nbytes
        if not 0 <= row < len(self.page_ids):
            raise ValueError(f"span row {row} is outside the request's {len(self.page_ids)} pages")

    def _copy_span(self, region: np.ndarray, op: TransferOp, span: Span) -> None:
        """region [count heads * block_size * head_dim] of the pool <-> those heads of one page of one layer."""
        pages = self.kv_pages
        row, in_row = divmod(span.staging_offset, pages.block_nbytes)
        layer, in_layer = divmod(in_row, pages.layer_block_nbytes)
        first, count = in_layer // self.head_nbytes, span.num_bytes // self.head_nbytes
        page_id, num_heads = self.page_ids[row], pages.num_kv_heads
        if self.is_whole and first == 0 and count == 2 * num_heads:  # K and V of every head: one copy
            _copy(region.reshape(2, num_heads, pages.block_size, pages.head_dim),
                  self.arrays[0][layer, :, page_id].transpose(0, 2, 1, 3), op)
            return
        heads = region.reshape(count, pages.block_size, pages.head_dim)  # [count, B, D]; K heads then V heads
        for kind in (0, 1):
            for (part, offset, is_writer), array in zip(self.parts, self.arrays):
                lo = max(first, kind * num_heads + offset)
                hi = min(first + count, kind * num_heads + offset + part.num_kv_heads)
                if lo >= hi or (op is TransferOp.WRITE and not is_writer):
                    continue
                in_page = array[layer, kind, page_id][:, lo - kind * num_heads - offset: hi - kind * num_heads - offset]
                _copy(heads[lo - first: hi - first], in_page.transpose(1, 0, 2), op)  # [h, B, D]


def page_segment_spans(kv_pages: KVPages, page_ids: Sequence[int], indices: Sequence[int],
                       offsets: Sequence[int], layer: int) -> list[Span]:
    """Layer `layer` of blocks `indices` as K and V ranges of the pages' buffer <-> pool `offsets`; only for
    pages of one KV head, whose token-major bytes are head-major."""
    assert kv_pages.num_kv_heads == 1, "a page of several KV heads is not one range of a head-major object"
    return [Span(offset + kv_pages.object_part_offset(layer, kind),
                 kv_pages.page_byte_offset(layer, kind, page_ids[index]), kv_pages.page_nbytes)
            for index, offset in zip(indices, offsets) for kind in (0, 1)]


def _copy(in_pool: np.ndarray, in_page: np.ndarray, op: TransferOp) -> None:
    """WRITE: in_page -> in_pool; READ: in_pool -> in_page (views of the same shape)."""
    if op is TransferOp.WRITE:
        np.copyto(in_pool, in_page)
    else:
        np.copyto(in_page, in_pool)


__all__ = ["PagesEnd", "page_segment_spans"]
