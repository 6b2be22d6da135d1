import random

import pytest

from mooncaked.kv.allocator import ExtentAllocator, OutOfSpace


def test_fills_exactly_and_reuses_freed_extents() -> None:
    allocator = ExtentAllocator(16 * 4096, alignment=4096)
    offsets = [allocator.allocate(4096) for _ in range(16)]
    assert sorted(offsets) == [i * 4096 for i in range(16)]
    with pytest.raises(OutOfSpace):
        allocator.allocate(1)
    allocator.free(offsets[3], 4096)
    assert allocator.allocate(100) == offsets[3]  # rounded up to one unit


def test_free_merges_neighbours_into_one_extent() -> None:
    allocator = ExtentAllocator(8 * 4096)
    offsets = [allocator.allocate(2 * 4096) for _ in range(4)]
    for offset in (offsets[1], offsets[3], offsets[2], offsets[0]):
        allocator.free(offset, 2 * 4096)
    assert allocator.num_used_bytes == 0
    assert allocator.largest_free_bytes == 8 * 4096
    assert allocator.allocate(8 * 4096) == 0


def test_random_workload_never_overlaps() -> None:
    rng = random.Random(1)
    allocator = ExtentAllocator(1 << 20, alignment=512)
    live: dict[int, int] = {}
    for _ in range(3000):
        if live and rng.random() < 0.45:
            offset = rng.choice(list(live))
            allocator.free(offset, live.pop(offset))
            continue
        size = rng.choice([512, 1000, 4096, 30000])
        try:
            offset = allocator.allocate(size)
        except OutOfSpace:
            continue
        live[offset] = size
        spans = sorted((o, o + allocator.extent_bytes(s)) for o, s in live.items())
        assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
    assert allocator.num_used_bytes == sum(allocator.extent_bytes(s) for s in live.values())


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="power of two"):
        ExtentAllocator(1 << 20, alignment=3000)
    with pytest.raises(ValueError, match="positive"):
        ExtentAllocator(1 << 20).allocate(0)
