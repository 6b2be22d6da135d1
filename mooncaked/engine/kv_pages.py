"""Device KV pages: one buffer of every layer's K and V pages (their page ids: engine/page_allocator.py).

1. `KVPages.for_model(args, num_pages, block_size, dtype, device)` allocates, once at start-up, one buffer
   [layers, planes, num_pages, block_size, kv_heads, row_width] (one allocation, so it registers with the transfer
   engine as one segment) and views it per layer as k_pages[layer] and v_pages[layer], each contiguous
   [num_pages, block_size, kv_heads, row_width]. A row is one token's one KV head: head_dim values of `dtype`
   (`kv.cache_dtype: auto`), or with `cache_dtype` int8 (fp8_e4m3) head_dim int8 (e4m3) values and their bfloat16
   scale, as uint8 (float8_e4m3fn)
   (kv/cache_dtype.py, kernels/quantized_kv.py): pages, store objects and transfers then all hold that form.
   The geometry is the model's (ModelArgs.num_kv_planes,
   num_kv_heads, kv_head_dim): 2 planes, K and V, of the KV heads (GQA); or one plane of one latent "head" (MLA:
   the compressed KV and the shared rope key), which k_pages and v_pages then both view.
2. Requests hold whole pages (engine/page_allocator.py) and name them in block tables; token t of a sequence
   lives in page block_table[t // block_size] at offset t % block_size. A freed page's contents are left as
   they are and simply overwritten by its next owner.

A store object has the pages' layout, [model layers, planes, block_size, model kv_heads, row_width] (docs/design.md
section 5): it always holds every KV head of the model, so it is the same bytes whatever the tensor-parallel degree
of the instance that wrote it; a rank's KV heads of one layer's K (or V) are the strided slice [:, heads] of it
(engine/tp/copy.py and engine/kv_copy.py copy them). Staging rows are whole objects' layers: [layers, planes,
block_size, kv_heads, row_width].
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from mooncaked.kv.cache_dtype import row_bytes, row_width
from mooncaked.model.config import LayerRange, ModelArgs, ShardShape

_PACKED_PAGE_DTYPES = {"int8": torch.uint8, "fp8_e4m3": torch.float8_e4m3fn}  # kernels/quantized_kv.py


class KVPages:
    """Owns the per-layer KV page tensors (a PageAllocator hands out their page ids). A pipeline stage holds
    pages for its own layers only: page layer i is model layer `first_layer + i`, and a store object still holds
    every model layer (`object_nbytes`). A tensor-parallel rank holds KV heads [kv_head_offset, kv_head_offset +
    num_kv_heads) of the model's `num_model_kv_heads`."""

    def __init__(self, *, num_layers: int, num_pages: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, first_layer: int = 0,
                 num_model_layers: int | None = None, kv_head_offset: int = 0,
                 num_model_kv_heads: int | None = None, buffer: torch.Tensor | None = None,
                 num_planes: int = 2, cache_dtype: str = "auto") -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if num_planes not in (1, 2):
            raise ValueError(f"num_planes must be 2 (K and V) or 1 (an MLA latent), got {num_planes}")
        self.num_planes = num_planes
        self.kv_head_offset = kv_head_offset
        self.num_model_kv_heads = num_kv_heads if num_model_kv_heads is None else num_model_kv_heads
        if not 0 <= kv_head_offset <= self.num_model_kv_heads - num_kv_heads:
            raise ValueError(f"KV heads [{kv_head_offset}, {kv_head_offset + num_kv_heads}) are not within the "
                             f"model's {self.num_model_kv_heads}")
        self.num_layers = num_layers
        self.first_layer = first_layer
        self.num_model_layers = num_layers if num_model_layers is None else num_model_layers
        if not 0 <= first_layer <= self.num_model_layers - num_layers:
            raise ValueError(f"layers [{first_layer}, {first_layer + num_layers}) are not within the model's "
                             f"{self.num_model_layers}")
        self.num_pages = num_pages
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.cache_dtype = cache_dtype
        self.row_width = row_width(head_dim, cache_dtype)  # elements of one token's one KV head
        self.model_dtype = dtype  # what attention computes in
        self.dtype = _PACKED_PAGE_DTYPES.get(cache_dtype, dtype)  # the buffer's
        dtype = self.dtype
        self.device = torch.device(device)
        shape = (num_layers, num_planes, num_pages, block_size, num_kv_heads, self.row_width)
        if buffer is None:
            self.buffer = torch.zeros(shape, dtype=dtype, device=device)
        else:  # memory shared with another process (a tensor-parallel rank's pages, engine/tp/pages.py)
            self.buffer = buffer.view(dtype).view(shape)
        # plane_pages[plane][layer]: what a store object's plane of that layer is copied to and from
        self.plane_pages = [[self.buffer[layer, plane] for layer in range(num_layers)] for plane in range(num_planes)]
        self.k_pages = self.plane_pages[0]
        self.v_pages = self.plane_pages[-1]  # one plane: the latent is both the keys and (its first columns) values

    @classmethod
    def for_model(cls, args: ModelArgs, *, num_pages: int, block_size: int, dtype: torch.dtype,
                  device: torch.device | str, layers: LayerRange | None = None,
                  shard: ShardShape | None = None, buffer: torch.Tensor | None = None,
                  cache_dtype: str = "auto") -> KVPages:
        """Pages of `layers` (default all), for the KV heads of `shard` (a tensor-parallel rank; default all),
        in `buffer` (flat uint8 of `nbytes_for(...)`) when given."""
        layers = layers or LayerRange.whole(args)
        shard = shard or ShardShape.whole(args)
        return cls(num_layers=layers.size, num_pages=num_pages, block_size=block_size,
                   num_kv_heads=shard.num_kv_heads, head_dim=args.kv_head_dim, dtype=dtype, device=device,
                   first_layer=layers.start, num_model_layers=args.num_layers, kv_head_offset=shard.kv_head_offset,
                   num_model_kv_heads=args.num_kv_heads, buffer=buffer, num_planes=args.num_kv_planes,
                   cache_dtype=cache_dtype)

    @staticmethod
    def nbytes_for(args: ModelArgs, shard: ShardShape, num_pages: int, block_size: int, dtype: torch.dtype,
                   layers: LayerRange | None = None, cache_dtype: str = "auto") -> int:
        """Bytes of the pages of `layers` (default all) for `shard`'s KV heads."""
        num_layers = args.num_layers if layers is None else layers.size
        return (num_layers * args.num_kv_planes * num_pages * block_size * shard.num_kv_heads
                * row_bytes(args.kv_head_dim, dtype.itemsize, cache_dtype))

    def copy_parts(self) -> list[tuple[KVPages, int, bool]]:
        """(pages, their first KV head in an object, whether stores read them): the pages an object's bytes are
        copied to and from. One instance's own pages; every rank's for a tensor-parallel instance
        (engine/tp_pages.py)."""
        return [(self, 0, True)]

    def copy_pages(self, source_ids: Sequence[int], target_ids: Sequence[int]) -> None:
        """Copy whole pages (every layer's K and V) onto others, in every part (each rank's, copy_parts): a
        parallel sampling's sequence starts from a copy of the prompt's partial last block."""
        for pages, _, _ in self.copy_parts():
            source = torch.tensor(list(source_ids), dtype=torch.long, device=pages.device)
            target = torch.tensor(list(target_ids), dtype=torch.long, device=pages.device)
            # float8 has no index_put on CPU: fp8_e4m3 rows are copied as their bytes
            buffer = pages.buffer.view(torch.uint8) if pages.buffer.dtype == torch.float8_e4m3fn else pages.buffer
            buffer[:, :, target] = buffer[:, :, source]

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page of one layer, of one plane (K, V, or an MLA latent)."""
        return self.block_size * self.num_kv_heads * self.row_width * self.dtype.itemsize

    def page_byte_offset(self, layer: int, plane: int, page_id: int) -> int:
        """Where page `page_id` of `layer`'s plane `plane` (K 0, V 1; an MLA latent 0) starts in `buffer`, in
        bytes."""
        return ((layer * self.num_planes + plane) * self.num_pages + page_id) * self.page_nbytes

    @property
    def layer_block_nbytes(self) -> int:
        """Bytes of one layer's planes for one block, every model KV head (one contiguous range of a store
        object, and a staging row's layer slice)."""
        return self.num_planes * self.block_size * self.num_model_kv_heads * self.row_width * self.dtype.itemsize

    @property
    def block_nbytes(self) -> int:
        """Bytes of this instance's layers' planes of one block (one staging row)."""
        return self.num_layers * self.layer_block_nbytes

    @property
    def object_nbytes(self) -> int:
        """Bytes of one store object: all model layers' planes of one block (docs/design.md section 5)."""
        return self.num_model_layers * self.layer_block_nbytes

    def object_layer_offset(self, layer: int) -> int:
        """Where page layer `layer` (model layer first_layer + layer) starts inside a store object."""
        return (self.first_layer + layer) * self.layer_block_nbytes

    def num_pages_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    @staticmethod
    def num_pages_fitting(memory_bytes: int, args: ModelArgs, block_size: int, dtype: torch.dtype,
                          cache_dtype: str = "auto") -> int:
        """How many pages `memory_bytes` holds for this model (for sizing from a memory budget)."""
        per_token = args.num_layers * args.num_kv_planes * args.num_kv_heads * row_bytes(args.kv_head_dim,
                                                                                          dtype.itemsize, cache_dtype)
        return memory_bytes // (per_token * block_size)
