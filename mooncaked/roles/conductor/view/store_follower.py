"""One store's keys in the conductor's shadow index (docs/design.md sections 6 and 7).

1. `resync()`: stream the store's DUMP (every key and the event seq it is current at) into the index.
2. `_follow_events()`: subscribe to EVENTS after that seq and apply BlockStored / BlockRemoved in order. The
   subscription's deadline (`events_renew_s`) ends it now and then; `run()` subscribes again from `last_seq`.
3. A gap in the seqs, an event window the store no longer holds (NotFound) or a broken connection makes the
   follower dump again; while the store is unreachable its keys leave the index (it serves no prefix).

`run()` loops until cancelled; its owner (the ClusterView) cancels and awaits it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TypeVar

from mooncaked.config import InstanceConfig
from mooncaked.kv.events import BLOCK_STORED
from mooncaked.roles.conductor.view.outages import OutageHistory
from mooncaked.rpc import DeadlineExceeded, NotFound, RpcClient, RpcError
from mooncaked.runtime.aio import aclose
from mooncaked.sched.shadow_index import ShadowIndex
from mooncaked.store import messages as kv_msg

logger = logging.getLogger(__name__)

T = TypeVar("T")


@asynccontextmanager
async def closing_stream(stream: AsyncIterator[T]) -> AsyncIterator[AsyncIterator[T]]:
    """Close an RPC stream when the block ends, so leaving early cancels the call on the server at once."""
    try:
        yield stream
    finally:
        await aclose(stream)


@dataclass(frozen=True)
class FollowerSettings:
    events_renew_s: float  # deadline of one event subscription; then it is renewed
    dump_timeout_s: float
    min_backoff_s: float  # first retry delay after a failure; doubles up to max_backoff_s
    max_backoff_s: float = 2.0


class StoreFollower:
    """Keeps one store's keys in the shadow index: dump, then events; dump again after any discontinuity.

    Owns its cursor (`last_seq`) and counters; writes only its own store's entries of the index."""

    def __init__(self, store: InstanceConfig, client: RpcClient, index: ShadowIndex,
                 settings: FollowerSettings) -> None:
        self.store = store
        self.client = client
        self.index = index
        self.settings = settings
        self.last_seq = -1
        self.needs_dump = True
        self.is_up = False
        self.num_resyncs = 0
        self.last_error = ""
        self.has_tried = asyncio.Event()
        self.outages = OutageHistory()

    async def run(self) -> None:
        backoff_s = self.settings.min_backoff_s
        while True:
            try:
                await self.sync_step(self.settings.events_renew_s)
                backoff_s = self.settings.min_backoff_s
            except Exception as exc:  # any failure: forget the store's keys, retry with backoff
                if not isinstance(exc, RpcError):
                    logger.exception("store %s: following failed unexpectedly", self.store.name)
                self._lost(exc)
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, self.settings.max_backoff_s)

    async def sync_step(self, events_s: float) -> None:
        """Dump when needed, then apply events for up to `events_s` (or until a gap)."""
        if self.needs_dump:
            await self.resync()
        try:
            await self._follow_events(events_s)
        except DeadlineExceeded:
            pass  # the subscription's deadline: renewed by the caller
        except NotFound as exc:
            logger.info("store %s no longer has the events after seq %d (%s): dumping", self.store.name,
                        self.last_seq, exc.message)
            self.needs_dump = True

    async def resync(self) -> None:
        seq, keys = 0, []
        stream = self.client.stream(kv_msg.DUMP, kv_msg.DumpRequest(), timeout_s=self.settings.dump_timeout_s)
        async with closing_stream(stream) as chunks:
            async for chunk in chunks:
                seq = chunk.seq
                keys.extend(chunk.keys)
        self.index.apply_dump(self.store.name, seq, keys)
        self.last_seq, self.needs_dump, self.is_up, self.last_error = seq, False, True, ""
        self.num_resyncs += 1
        self.has_tried.set()
        logger.info("store %s: index resynced from a dump of %d keys at seq %d", self.store.name, len(keys), seq)

    async def _follow_events(self, timeout_s: float) -> None:
        request = kv_msg.EventsRequest(after_seq=self.last_seq)
        async with closing_stream(self.client.stream(kv_msg.EVENTS, request, timeout_s=timeout_s)) as batches:
            async for batch in batches:
                for event in batch.events:
                    if not self._apply(event):
                        logger.info("store %s events jumped from seq %d to %d: dumping", self.store.name,
                                    self.last_seq, event.seq)
                        self.needs_dump = True
                        return

    def _apply(self, event: kv_msg.StoreEventMessage) -> bool:
        name = self.store.name
        if event.kind == BLOCK_STORED:
            is_in_order = self.index.apply_stored(name, event.seq, [event.key])
        else:
            is_in_order = self.index.apply_removed(name, event.seq, [event.key])
        self.last_seq = max(self.last_seq, event.seq) if is_in_order else self.last_seq
        return is_in_order

    def _lost(self, exc: Exception) -> None:
        """A store we cannot reach serves no prefix: forget its keys until it answers a dump again."""
        if self.is_up or not self.last_error:
            logger.warning("store %s unreachable (%s): its keys leave the index until it is back",
                           self.store.name, exc)
        if self.is_up:
            self.outages.record(time.monotonic())
        self.index.remove_store(self.store.name)
        self.index.add_store(self.store.name)
        self.is_up, self.needs_dump, self.last_error = False, True, str(exc)
        self.has_tried.set()  # start-up waits for a first attempt, not for the store to come up
