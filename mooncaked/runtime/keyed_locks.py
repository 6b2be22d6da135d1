"""Mutual exclusion per key (a client, a store) without keeping a lock for every key ever seen.

1. `async with locks.hold(key):` waits for the key's lock and holds it for the block.
2. A key's lock exists only while someone holds it or waits for it: the last one out removes it, so the number of
   locks is bounded by the callers in flight, not by the number of distinct keys.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field


@dataclass
class _Entry:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    num_users: int = 0  # holding or waiting


class KeyedLocks:
    """Owns one lock per key in use (owned by whoever serialises work per key)."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry()
        entry.num_users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.num_users -= 1
            if not entry.num_users:
                del self._entries[key]
