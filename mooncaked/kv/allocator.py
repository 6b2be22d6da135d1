"""Extent allocator over the store's DRAM pool (byte ranges, no I/O).

1. The pool is `capacity_bytes` long, cut into `alignment`-byte units; every extent starts on a unit boundary.
2. `allocate(num_bytes)` takes an exact-size free extent when one exists (the common case: every block of one
   model has the same size), else splits the smallest free extent that fits (best fit).
3. `free(offset, num_bytes)` returns an extent and merges it with free neighbours, so the pool never fragments
   into pieces smaller than what was freed.

Pure bookkeeping: the store's metadata (`kv/store_core.py`) is the only caller and owns the allocator.
"""

from __future__ import annotations

import bisect


class OutOfSpace(Exception):
    """No free extent is large enough; the caller evicts and retries, or reports the store full."""


class ExtentAllocator:
    """Free-space map of one pool. Owner: the `StoreCore` that created it.

    Invariant: free extents never overlap or touch (touching ones are merged); `_free_by_start`,
    `_free_by_end` and `_starts_by_size` describe the same set of extents.
    """

    def __init__(self, capacity_bytes: int, alignment: int = 4096) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a positive power of two, got {alignment}")
        if capacity_bytes < alignment:
            raise ValueError(f"capacity_bytes ({capacity_bytes}) must be at least one alignment unit ({alignment})")
        self.alignment = alignment
        self.capacity_bytes = capacity_bytes - capacity_bytes % alignment
        self.num_used_bytes = 0
        self._free_by_start: dict[int, int] = {}
        self._free_by_end: dict[int, int] = {}
        self._starts_by_size: dict[int, set[int]] = {}
        self._sizes: list[int] = []  # sorted distinct sizes present in _starts_by_size
        self._add_free(0, self.capacity_bytes)

    def extent_bytes(self, num_bytes: int) -> int:
        """Bytes an object of `num_bytes` occupies (rounded up to the alignment)."""
        return -(-num_bytes // self.alignment) * self.alignment

    @property
    def largest_free_bytes(self) -> int:
        return self._sizes[-1] if self._sizes else 0

    def allocate(self, num_bytes: int) -> int:
        """Offset of a fresh extent of at least `num_bytes`; raises OutOfSpace when none fits."""
        if num_bytes <= 0:
            raise ValueError(f"num_bytes must be positive, got {num_bytes}")
        size = self.extent_bytes(num_bytes)
        index = bisect.bisect_left(self._sizes, size)
        if index == len(self._sizes):
            raise OutOfSpace(f"no free extent of {size} bytes (largest free: {self.largest_free_bytes})")
        found_size = self._sizes[index]
        start = next(iter(self._starts_by_size[found_size]))
        self._remove_free(start, found_size)
        if found_size > size:
            self._add_free(start + size, found_size - size)
        self.num_used_bytes += size
        return start

    def free(self, offset: int, num_bytes: int) -> None:
        """Return an extent handed out by `allocate` (same `num_bytes`)."""
        size = self.extent_bytes(num_bytes)
        assert offset % self.alignment == 0 and 0 <= offset and offset + size <= self.capacity_bytes
        assert offset not in self._free_by_start, f"double free at offset {offset}"
        self.num_used_bytes -= size
        start, end = offset, offset + size
        before = self._free_by_end.get(start)
        if before is not None:
            self._remove_free(before, start - before)
            start = before
        after_size = self._free_by_start.get(end)
        if after_size is not None:
            self._remove_free(end, after_size)
            end += after_size
        self._add_free(start, end - start)

    def _add_free(self, start: int, size: int) -> None:
        self._free_by_start[start] = size
        self._free_by_end[start + size] = start
        starts = self._starts_by_size.get(size)
        if starts is None:
            self._starts_by_size[size] = {start}
            bisect.insort(self._sizes, size)
        else:
            starts.add(start)

    def _remove_free(self, start: int, size: int) -> None:
        del self._free_by_start[start]
        del self._free_by_end[start + size]
        starts = self._starts_by_size[size]
        starts.discard(start)
        if not starts:
            del self._starts_by_size[size]
            self._sizes.pop(bisect.bisect_left(self._sizes, size))
