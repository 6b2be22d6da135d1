"""Where a request's blocks lie: in a store (StoreBlocks), and one layer of them at each end of a move (its pages,
its staging rows, a store object).

0. StoreBlocks names some of a request's blocks and their pool offsets in one store: a load's sources, a store's
   writes, and the same on the wire to a prefill group's later stages (group/messages.py).
1. A prompt of `num_tokens` takes num_blocks_for(num_tokens, block_size) blocks (the partial tail included).
2. A store object holds one block of every layer of the model in the pages' layout (docs/design.md section 5); a
   worker's layer i is the object's layer first_layer + i (KVPages.object_layer_offset).
3. page_spans: straight between the pages and a pool: each block's page of each plane (K and V, or an MLA
   latent), one span a plane.
4. staging_spans: through staging: row n holds block n's layers of this worker, one span a block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mooncaked.engine.kv_pages import KVPages
from mooncaked.rpc import Message
from mooncaked.store.move_ends import Span


@dataclass(frozen=True)
class StoreBlocks(Message):
    """Blocks `block_indices` of a request (its page and staging row indices) are store objects at pool `offsets`
    of store `store_name`."""

    store_name: str
    block_indices: list[int]
    offsets: list[int]
    incarnation: int = 0  # the store run the offsets belong to (store/client.py); 0: unchecked


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def page_spans(kv_pages: KVPages, page_ids: Sequence[int], indices: Sequence[int], offsets: Sequence[int],
               layer: int) -> list[Span]:
    """Layer `layer` of blocks `indices` as each plane's page ranges of the pages' buffer <-> pool `offsets`."""
    layer_offset, page_bytes = kv_pages.object_layer_offset(layer), kv_pages.page_nbytes
    return [Span(offset + layer_offset + plane * page_bytes, kv_pages.page_byte_offset(layer, plane, page_ids[index]),
                 page_bytes)
            for index, offset in zip(indices, offsets) for plane in range(kv_pages.num_planes)]


def staging_spans(kv_pages: KVPages, indices: Sequence[int], offsets: Sequence[int], layer: int) -> list[Span]:
    """Layer `layer` of blocks `indices` as staging row ranges <-> pool `offsets`."""
    # staging rows hold this worker's layers only; the store object every layer of the model
    row, size, in_object = kv_pages.block_nbytes, kv_pages.layer_block_nbytes, kv_pages.object_layer_offset(layer)
    return [Span(offset + in_object, index * row + layer * size, size) for index, offset in zip(indices, offsets)]
