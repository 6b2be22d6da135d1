"""Block copies between pages and staging in the store object layout (docs/design.md section 5)."""

from __future__ import annotations

import pytest
import torch

from mooncaked.engine.kv_copy import KVCopier, layer_byte_range, new_staging, staging_view
from mooncaked.engine.kv_pages import KVPages


def _pages() -> KVPages:
    kv = KVPages(num_layers=3, num_pages=6, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                 device="cpu")
    gen = torch.Generator().manual_seed(0)
    for layer in range(3):
        kv.k_pages[layer].copy_(torch.randn(kv.k_pages[layer].shape, generator=gen))
        kv.v_pages[layer].copy_(torch.randn(kv.v_pages[layer].shape, generator=gen))
    return kv


def test_layer_slice_is_one_contiguous_range_k_then_v() -> None:
    kv = _pages()
    staging = new_staging(kv, 2)
    handle = KVCopier("cpu").store_all_layers(kv, staging, [4, 1])
    assert not handle.is_done()  # on CPU the copy runs where it is synchronized: the worker's copy thread
    handle.synchronize()
    assert handle.is_done()
    raw = staging.view(torch.uint8).reshape(2, kv.block_nbytes)
    for n, page in enumerate([4, 1]):
        for layer in range(3):
            offset, length = layer_byte_range(kv, layer)
            chunk = raw[n, offset: offset + length].view(torch.float32)
            half = length // 8
            assert torch.equal(chunk[:half].view(4, 2, 8), kv.k_pages[layer][page])
            assert torch.equal(chunk[half:].view(4, 2, 8), kv.v_pages[layer][page])


def test_layerwise_store_then_load_round_trips_into_other_pages() -> None:
    src, dst = _pages(), _pages()
    buffer = torch.zeros(2 * src.block_nbytes + 16, dtype=torch.uint8)  # e.g. a mapped store region
    staging = staging_view(buffer, src, 2)
    copier = KVCopier("cpu")
    for layer in range(3):
        copier.store_layer(src, layer, staging, [0, 5]).synchronize()
    for layer in range(3):
        copier.load_layer(dst, layer, staging, [3, 2]).wait_on_current_stream()
    for layer in range(3):
        assert torch.equal(dst.k_pages[layer][[3, 2]], src.k_pages[layer][[0, 5]])
        assert torch.equal(dst.v_pages[layer][[3, 2]], src.v_pages[layer][[0, 5]])


def test_load_all_layers_and_shape_check() -> None:
    src, dst = _pages(), _pages()
    staging = new_staging(src, 1)
    copier = KVCopier("cpu")
    copier.store_all_layers(src, staging, [2]).synchronize()
    copier.load_all_layers(dst, staging, [0]).synchronize()
    assert all(torch.equal(dst.v_pages[i][0], src.v_pages[i][2]) for i in range(3))
    with pytest.raises(ValueError, match="staging must be"):
        copier.load_all_layers(dst, staging, [0, 1])
