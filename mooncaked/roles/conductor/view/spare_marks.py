"""The conductor's sender of spare marks (`store.mark_spare`), in the background, off the request path.

1. `SpareMarkSender(tracker, client_for, costs, clock, interval_s, timeout_s)`; its owner runs `run()` as a task
   and cancels it: every `interval_s` it takes the replica tracker's marks (`mooncaked.sched.replicas`) and makes
   one MARK_SPARE call per store with changes (at most `max_keys_per_call` keys each), concurrently, each with
   its own deadline.
2. A call that fails gives its marks back to the tracker, which sends them again next round; a store that went
   away loses its keys from the shadow index, and with them its marks.
Requests never wait for marks: until one arrives, a store evicts by its base order, which is the paper's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from mooncaked.sched.replicas import BlockCosts, ReplicaTracker, StoreMarks
from mooncaked.store import messages as msg
from mooncaked.store.client import RpcCaller

logger = logging.getLogger(__name__)


class SpareMarkSender:
    """Owns nothing but its counters; borrows the tracker (the cluster view's) and the store clients."""

    def __init__(self, tracker: ReplicaTracker, client_for: Callable[[str], RpcCaller | None],
                 costs: Callable[[], BlockCosts], clock: Callable[[], float], *, interval_s: float,
                 timeout_s: float, max_keys_per_call: int = 32768) -> None:
        if not interval_s > 0 or not timeout_s > 0 or max_keys_per_call < 1:
            raise ValueError("interval_s and timeout_s must be positive and max_keys_per_call >= 1")
        self.tracker = tracker
        self.client_for = client_for
        self.costs = costs
        self.clock = clock
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.max_keys_per_call = max_keys_per_call
        self.num_marks_sent = 0
        self.num_failed_calls = 0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.send_once()

    async def send_once(self) -> None:
        """One round: every store's pending marks, in calls that run side by side."""
        marks = self.tracker.take_marks(self.costs(), self.clock())
        calls = [self._send(store_id, chunk) for store_id, store_marks in marks.items()
                 for chunk in self._chunks(store_marks)]
        if calls:
            await asyncio.gather(*calls)

    def _chunks(self, marks: StoreMarks) -> list[StoreMarks]:
        size = self.max_keys_per_call
        chunks = [StoreMarks(spare=marks.spare[i:i + size]) for i in range(0, len(marks.spare), size)]
        chunks += [StoreMarks(kept=marks.kept[i:i + size]) for i in range(0, len(marks.kept), size)]
        return chunks

    async def _send(self, store_id: str, marks: StoreMarks) -> None:
        client = self.client_for(store_id)
        if client is None:
            return  # not a store this conductor follows: nothing to tell
        request = msg.MarkSpareRequest([k for k in marks.spare if isinstance(k, bytes)],
                                       [k for k in marks.kept if isinstance(k, bytes)])
        try:
            await client.call(msg.MARK_SPARE, request, timeout_s=self.timeout_s)
        except Exception as exc:  # any failure: the tracker sends these marks again next round
            self.num_failed_calls += 1
            self.tracker.undo_marks(store_id, marks)
            logger.info("store %s: spare marks not delivered (%s); sending them again", store_id, exc)
            return
        self.num_marks_sent += len(marks.spare) + len(marks.kept)
