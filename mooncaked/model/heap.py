"""Giving freed heap memory back to the operating system (glibc), so resident memory shows what is in use.

1. `release_free_heap()` after a phase that allocated and freed a lot: loading and packing the weights
   (a dense copy of every projection, probe products), a worker's self-profile (prompt-sized activations).
   glibc keeps freed chunks in its arenas (the compute thread has its own) and returns them only from the top
   of each heap; `malloc_trim(0)` releases every free page. Elsewhere (another libc) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Any:
    """glibc's malloc_trim, or None."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def release_free_heap() -> bool:
    """Return free heap pages to the OS; False where the C library cannot."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
