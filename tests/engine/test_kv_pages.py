"""Page allocator ownership and KV page shapes."""

from __future__ import annotations

import pytest
import torch

from mooncaked.engine.kv_pages import KVPages
from mooncaked.engine.page_allocator import PageAllocator, PagesExhausted
from mooncaked.model.presets import random_preset


def test_allocate_is_all_or_nothing_and_tracks_owners() -> None:
    alloc = PageAllocator(4)
    a = alloc.allocate(3, "a")
    assert alloc.num_free == 1 and all(alloc.owner_of(p) == "a" for p in a)
    with pytest.raises(PagesExhausted, match="needs 2 KV pages, 1 free"):
        alloc.allocate(2, "b")
    assert alloc.num_free == 1 and alloc.pages_of("b") == []


def test_free_checks_the_owner_and_double_free() -> None:
    alloc = PageAllocator(4)
    a = alloc.allocate(2, "a")
    with pytest.raises(ValueError, match="not held by 'b'"):
        alloc.free(a, "b")
    alloc.free(a[:1], "a")
    with pytest.raises(ValueError, match="not held"):
        alloc.free(a[:1], "a")
    assert alloc.free_owner("a") == 1 and alloc.num_free == 4 and alloc.num_used == 0


def test_pages_shapes_and_sizes() -> None:
    args = random_preset("tiny")
    kv = KVPages.for_model(args, num_pages=5, block_size=8, dtype=torch.float16, device="cpu")
    assert len(kv.k_pages) == args.num_layers and kv.k_pages[0].shape == (5, 8, 2, 16)
    assert kv.layer_block_nbytes == 2 * 8 * 2 * 16 * 2 and kv.block_nbytes == args.num_layers * kv.layer_block_nbytes
    assert kv.num_pages_for(17) == 3
    assert KVPages.num_pages_fitting(kv.block_nbytes * 7, args, 8, torch.float16) == 7
