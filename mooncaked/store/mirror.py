"""A subscriber's mirror of one store's key set (what a conductor's shadow index is built from).

1. `resync(client)` replaces the mirror with a dump: every present key as of sequence number `last_seq`.
2. `apply(batch)` applies events in order; an event whose seq is not `last_seq + 1` is a gap: nothing more is
   applied and the caller must resync.
3. `follow(client, duration_s)` does both: dump, then stream events, resyncing on a gap or when the store says
   the events it needs are gone; it returns at the deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time

from mooncaked.kv.events import BLOCK_STORED
from mooncaked.rpc import DeadlineExceeded, NotFound
from mooncaked.store import messages as msg
from mooncaked.store.client import StoreClient

logger = logging.getLogger(__name__)


class StoreKeyMirror:
    """Owns the mirrored key set and the sequence number it reflects."""

    def __init__(self) -> None:
        self.keys: set[bytes] = set()
        self.last_seq = -1  # no dump yet
        self.num_resyncs = 0

    async def resync(self, client: StoreClient) -> None:
        seq, keys = await client.dump()
        self.keys = set(keys)
        self.last_seq = seq
        self.num_resyncs += 1

    def apply(self, batch: msg.EventBatch) -> bool:
        """Apply the batch; False at the first gap (the mirror then needs `resync`)."""
        for event in batch.events:
            if event.seq <= self.last_seq:
                continue  # already reflected by a dump
            if event.seq != self.last_seq + 1:
                logger.info("store events jumped from seq %d to %d: resync", self.last_seq, event.seq)
                return False
            if event.kind == BLOCK_STORED:
                self.keys.add(event.key)
            else:
                self.keys.discard(event.key)
            self.last_seq = event.seq
        return True

    async def follow(self, client: StoreClient, duration_s: float) -> None:
        """Keep the mirror current until `duration_s` from now."""
        deadline = time.monotonic() + duration_s
        while time.monotonic() < deadline:
            if self.last_seq < 0:
                await self.resync(client)
            remaining = deadline - time.monotonic()
            try:
                is_in_order = await self._stream(client, remaining)
            except NotFound:
                is_in_order = False
            except (DeadlineExceeded, asyncio.TimeoutError):
                return
            if not is_in_order:
                self.last_seq = -1

    async def _stream(self, client: StoreClient, timeout_s: float) -> bool:
        if timeout_s <= 0:
            return True
        stream = client.rpc.stream(msg.EVENTS, msg.EventsRequest(self.last_seq), timeout_s=timeout_s)
        try:
            async for batch in stream:
                if not self.apply(batch):
                    return False
        finally:
            close = getattr(stream, "aclose", None)
            if close is not None:
                await close()  # ends the server-side stream when we leave early
        return True
