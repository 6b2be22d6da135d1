"""Store moves of a tensor-parallel instance (CPU): whole objects' bytes <-> every rank's pages, strided copies.

1. `RankPagesEnd(sharded_pages, page_ids)` is the local end of one request's moves: it takes the spans a staging
   buffer would (`Span.staging_offset` is an offset in staging rows [N, layers, planes, block_size, kv_heads,
   head_dim], row n for the page `page_ids[n]`), so a move names its bytes the same way whichever end it has.
2. `copy_spans(pool, op, spans)` (run on the worker's copy thread by StoreClient.move, for this host's store
   whose pool the worker maps) copies each span, one layer of one object viewed as [planes, block_size, kv_heads,
   head_dim], to and from each rank's page [planes, block_size, rank's heads, head_dim]: the object's slice
   [:, :, heads] (`KVPages.copy_parts`). A READ fills every rank holding a head (replicas too), a WRITE reads
   each head from the first rank holding it. Objects and pages are token-major alike: no transpose.
Moves through staging (another host's store; CUDA ranks) copy each rank's heads of the rows (engine/kv_copy.py).
Copies are numpy over same-size integers (bfloat16 too): a fraction of torch's per-call cost per page.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from mooncaked.engine.kv_pages import KVPages
from mooncaked.store.move_ends import Span
from mooncaked.transfer import TransferOp

_SAME_SIZE_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class RankPagesEnd:
    """One request's view of every rank's pages as the local end of its moves; owns nothing."""

    def __init__(self, kv_pages: KVPages, page_ids: Sequence[int]) -> None:
        assert kv_pages.device.type == "cpu", "only host pages are copied to and from object bytes here"
        self.kv_pages = kv_pages
        self.page_ids = list(page_ids)
        self.parts = kv_pages.copy_parts()
        int_dtype = _SAME_SIZE_INTS[kv_pages.dtype.itemsize]
        self.arrays = [part.buffer.view(int_dtype).numpy() for part, _, _ in self.parts]  # [L, planes, P, B, Hl, D]

    def copy_spans(self, pool: np.ndarray, op: TransferOp, spans: Sequence[Span]) -> None:
        """READ: pool -> pages; WRITE: pages -> pool. `pool` is this host's store pool, mapped (flat uint8)."""
        for span in spans:
            self._check(span, pool.nbytes)
            region = pool[span.pool_offset: span.pool_offset + span.num_bytes].view(self.arrays[0].dtype)
            row, in_row = divmod(span.staging_offset, self.kv_pages.block_nbytes)
            self._copy_layer(region, op, in_row // self.kv_pages.layer_block_nbytes, self.page_ids[row])

    def _check(self, span: Span, pool_nbytes: int) -> None:
        pages = self.kv_pages
        if span.pool_offset < 0 or span.pool_offset + span.num_bytes > pool_nbytes:
            raise ValueError(f"pool range [{span.pool_offset}, +{span.num_bytes}) is outside the pool")
        if span.staging_offset % pages.layer_block_nbytes or span.num_bytes != pages.layer_block_nbytes:
            raise ValueError(f"span at row offset {span.staging_offset} of {span.num_bytes} bytes is not one layer "
                             f"of one block ({pages.layer_block_nbytes} bytes)")
        row = span.staging_offset // pages.block_nbytes
        if not 0 <= row < len(self.page_ids):
            raise ValueError(f"span row {row} is outside the request's {len(self.page_ids)} pages")

    def _copy_layer(self, region: np.ndarray, op: TransferOp, layer: int, page_id: int) -> None:
        """region: one layer of one object, [planes * B * Hkv * D] <-> each rank's heads of page `page_id`."""
        pages = self.kv_pages
        in_object = region.reshape(pages.num_planes, pages.block_size, pages.num_kv_heads, pages.row_width)
        for (part, head, is_writer), array in zip(self.parts, self.arrays):
            heads = in_object[:, :, head: head + part.num_kv_heads]  # [planes, B, Hl, D], strided
            in_page = array[layer, :, page_id]  # [planes, B, Hl, D]
            if op is TransferOp.READ:
                np.copyto(in_page, heads)
            elif is_writer:  # of a replicated KV head, the first rank holding it
                np.copyto(heads, in_page)


__all__ = ["RankPagesEnd"]
