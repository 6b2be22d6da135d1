"""The store's event streams over RPC: EVENTS (`BlockStored` / `BlockRemoved` as they happen) and DUMP.

1. The StoreService calls `notify()` after every core call that appended an event (and when the SSD tier dropped
   a block): each waiting stream wakes and reads the core's event log.
2. `events(request, ctx)` streams the events after `after_seq` in batches until the call's deadline or `end()`;
   a subscriber that fell behind the retained window gets NotFound and resyncs from a dump.
3. `dump(request, ctx)` streams every present key in chunks, with the sequence number the dump is consistent with.
4. `end()` (the store stopping or draining) finishes every stream; a subscriber resubscribes elsewhere or later.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Protocol

from mooncaked.kv.store_core import StoreCore
from mooncaked.rpc import InvalidArgument, NotFound
from mooncaked.store import messages as msg


class CallDeadline(Protocol):
    deadline: float  # time.monotonic() based


class EventStreams:
    """Owns the wake-up of waiting streams and whether they have ended; borrows the StoreService's core."""

    def __init__(self, core: StoreCore) -> None:
        self.core = core
        self._new_events = asyncio.Event()
        self._is_ended = False

    def notify(self) -> None:
        self._new_events.set()
        self._new_events = asyncio.Event()

    def end(self) -> None:
        """Finish every event stream now (their subscribers resubscribe elsewhere or later)."""
        self._is_ended = True
        self.notify()

    async def events(self, request: msg.EventsRequest, ctx: CallDeadline) -> AsyncIterator[msg.EventBatch]:
        """Events after `after_seq` as they happen, until the call's deadline or the store stops."""
        if request.after_seq < 0 or request.max_batch <= 0:
            raise InvalidArgument("after_seq must be >= 0 and max_batch > 0")
        cursor = request.after_seq
        while not self._is_ended:
            events = self.core.events_after(cursor, request.max_batch)
            if events is None:
                raise NotFound(f"events after seq {cursor} are no longer retained (oldest is "
                               f"{self.core.events.first_retained_seq}); call dump and resubscribe after its seq")
            if events:
                cursor = events[-1].seq
                yield msg.EventBatch([msg.StoreEventMessage(e.seq, e.kind, e.key) for e in events])
                continue
            waiter = self._new_events
            remaining = ctx.deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                await asyncio.wait_for(waiter.wait(), min(remaining, 1.0))
            except asyncio.TimeoutError:
                pass

    async def dump(self, request: msg.DumpRequest, ctx: object) -> AsyncIterator[msg.DumpChunk]:
        if request.max_chunk_keys <= 0:
            raise InvalidArgument(f"max_chunk_keys must be positive, got {request.max_chunk_keys}")
        seq, keys = self.core.dump()
        step = request.max_chunk_keys
        for start in range(0, max(len(keys), 1), step):
            yield msg.DumpChunk(seq, keys[start : start + step], is_last=start + step >= len(keys))
