"""Whether each prefill and decode instance is up, and what its last LOAD reply said (the cluster view's polls).

1. `poll(worker)` runs as one supervised task per worker (the ClusterView starts and cancels it): every
   `poll_interval_s` a LOAD call with its own deadline (`poll_timeout_s`). A reply marks the worker up and keeps
   its load, hands its fitted performance model to the live predictors (predictors.py) and applies the block
   keys its device prefix cache gained and lost since the last poll (or all of them) to the device index (one
   "store" per instance, by instance name; a gap in the seqs makes the next poll ask for a dump).
2. `report_failure()` (a failed poll, or a request's leg: leg.py) marks the instance down until a poll succeeds
   again, records the outage, and calls what watches it (`watch_down`: a DECODE stream waiting for its next
   token gives up at once). A prefill group's failed first stage takes every member down with it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from mooncaked.config import PrefillGroupConfig
from mooncaked.roles.base import PeerClients
from mooncaked.roles.conductor.view.instances import WorkerState
from mooncaked.roles.conductor.view.predictors import LivePredictors
from mooncaked.roles.worker.messages import LOAD, LoadReply, LoadRequest
from mooncaked.rpc import RpcError
from mooncaked.sched.shadow_index import ShadowIndex

logger = logging.getLogger(__name__)


class WorkerHealth:
    """Owns nothing of its own; updates the borrowed worker states (the ClusterView's `prefill` and `decode`), the
    device index and the live predictors from each LOAD reply and each report of a failure."""

    def __init__(self, peers: PeerClients, run_id: int, prefill: dict[str, WorkerState],
                 decode: dict[str, WorkerState], groups: dict[str, PrefillGroupConfig], device_index: ShadowIndex,
                 predictors: LivePredictors, *, poll_interval_s: float, poll_timeout_s: float) -> None:
        self.peers = peers
        self.run_id = run_id
        self.prefill = prefill
        self.decode = decode
        self.groups = groups  # by first stage
        self.device_index = device_index
        self.predictors = predictors
        self.poll_interval_s = poll_interval_s
        self.poll_timeout_s = poll_timeout_s

    async def poll(self, worker: WorkerState) -> None:
        client = self.peers.for_instance(worker.instance)
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                seq = self.device_index.last_seq(worker.instance.name)
                reply = await client.call(LOAD, LoadRequest(self.run_id, seq), timeout_s=self.poll_timeout_s)
            except Exception as exc:  # down until a poll succeeds again
                if not isinstance(exc, RpcError):
                    logger.exception("LOAD from %s failed unexpectedly", worker.instance.name)
                self.report_failure(worker.instance.name, str(exc))
            else:
                self.loaded(worker, reply, seq)
            worker.has_polled.set()
            await asyncio.sleep(max(self.poll_interval_s - (loop.time() - started), 0.0))

    def loaded(self, worker: WorkerState, reply: LoadReply, sent_seq: int = -1) -> None:
        """One LOAD reply to a request that carried `sent_seq` (the device index's last seq of this worker)."""
        if not worker.is_up:
            logger.info("%s %s is up", worker.instance.role, worker.instance.name)
        worker.load, worker.polled_at, worker.is_up, worker.last_error = reply, time.monotonic(), True, ""
        self.predictors.report(worker.instance.name, reply.prefill_coefficients, reply.decode_coefficients)
        self._device_keys(worker.instance.name, sent_seq, reply)

    def _device_keys(self, name: str, sent_seq: int, reply: LoadReply) -> None:
        """The device prefix cache's report into the device index (a gap makes the next poll ask for a dump)."""
        if reply.is_device_cache_dump:
            self.device_index.apply_dump(name, reply.device_cache_seq, reply.device_keys_gained)
        elif sent_seq >= 0:
            self.device_index.apply_changes(name, sent_seq, reply.device_cache_seq, reply.device_keys_gained,
                                            reply.device_keys_lost)

    def report_failure(self, instance_name: str, reason: str) -> None:
        """Mark an instance down (a failed poll or request leg) until a LOAD call succeeds again. A prefill group's
        failed leg marks every member down: the one that failed stays down until it answers again, so the group
        takes nothing meanwhile even if this conductor's poll has not yet noticed it."""
        group = self.groups.get(instance_name)
        for member in group.members[1:] if group is not None else ():
            state = self.prefill.get(member)
            if state is not None:  # not an outage of its own: its next answered poll brings it back
                state.is_up = False
        worker = self.prefill.get(instance_name) or self.decode.get(instance_name)
        if worker is None:
            return
        if worker.is_up:
            logger.warning("%s %s is down: %s", worker.instance.role, instance_name, reason)
            worker.outages.record(time.monotonic())
        worker.is_up, worker.last_error = False, reason
        for watcher in list(worker.down_watchers):
            watcher()

    def watch_down(self, instance_name: str, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` at each report of `instance_name` down (a failed poll or leg) until the returned
        function is called."""
        worker = self.prefill.get(instance_name) or self.decode.get(instance_name)
        if worker is None:
            return lambda: None
        worker.down_watchers.add(callback)
        return lambda: worker.down_watchers.discard(callback)
