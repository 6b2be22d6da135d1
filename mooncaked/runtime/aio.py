"""Ending an async iterator that a consumer stops reading early.

1. A consumer reads an async iterator (an RPC stream, an async generator, a backend's chunks).
2. When it stops, finished or not (an error, a cancellation, a client gone), it calls `aclose(iterator)` in a
   `finally`: one with an `aclose` (a generator, an RPC stream: the call is then cancelled on the server at once)
   is closed; any other has nothing to end.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any


async def aclose(iterator: AsyncIterator[Any]) -> None:
    """Close `iterator` when it can be closed; awaits nothing otherwise."""
    close = getattr(iterator, "aclose", None)
    if close is not None:
        await close()
