"""Staging buffers: reused across requests (registered once), dropped when a transfer may still touch them."""

from __future__ import annotations

import pytest
import torch

from mooncaked.engine.kv_pages import KVPages
from mooncaked.engine.staging_pool import StagingPool


def make_pool(max_free_bytes: int | None = None) -> tuple[StagingPool, list[str], list[str]]:
    kv = KVPages(num_layers=2, num_pages=8, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                 device="cpu")
    registered: list[str] = []
    unregistered: list[str] = []
    pool = StagingPool(kv, "p0", lambda name, data: registered.append(name), unregistered.append,
                       max_free_bytes=max_free_bytes)
    return pool, registered, unregistered


def test_a_released_buffer_is_reused_without_registering_again() -> None:
    pool, registered, unregistered = make_pool()
    first = pool.acquire(3)
    assert first.num_blocks == 4 and registered == [first.name]  # rounded up to a power of two
    view = pool.view(first, 3)
    assert view.shape == (3, 2, 2, 4, 2, 8) and view.data_ptr() == first.data.data_ptr()
    pool.release(first)
    again = pool.acquire(4)
    assert again is first and registered == [first.name] and not unregistered
    other = pool.acquire(1)  # the only free one is in use: a new buffer
    assert other is not first and registered == [first.name, other.name]


def test_the_smallest_fitting_buffer_is_taken() -> None:
    pool, _, _ = make_pool(max_free_bytes=1 << 20)
    big, small = pool.acquire(8), pool.acquire(2)
    pool.release(big)
    pool.release(small)
    assert pool.acquire(2) is small and pool.acquire(2) is big


def test_an_unclean_buffer_is_dropped_and_free_bytes_are_capped() -> None:
    pool, _, unregistered = make_pool(max_free_bytes=4 * 1024)
    buffer = pool.acquire(1)
    pool.release(buffer, is_reusable=False)
    assert unregistered == [buffer.name] and pool.num_buffers == 0
    kept, dropped = pool.acquire(1), pool.acquire(16)
    pool.release(kept)
    pool.release(dropped)  # 16 blocks of 1 KiB exceed the cap: the largest free buffer goes
    assert unregistered[-1] == dropped.name and pool.num_buffers == 1
    with pytest.raises(ValueError, match="is not in use"):
        pool.release(kept)
    pool.close()
    assert kept.name in unregistered
