"""The conductor's view of the cluster: which store holds which block, how loaded each worker is, who is up.

1. `start()` registers every configured store with the shadow index and starts, per store, a `StoreFollower`
   (full dump, then the store's event stream; a gap, a lost event window or a broken connection makes it dump
   again) and, per prefill/decode instance, a LOAD poller (every `poll_interval_s`, each call with its own
   deadline). It returns once every store was dumped and every worker polled once (or `startup_timeout_s`
   passed), so a restarted conductor places its first request on a fresh index.
2. Per request the backend calls `place()` (Algorithm 1 over the live views, or an inline placement on a decode
   instance when no prefill instance is configured or the prompt's uncached part is small enough), then
   `begin()`, `prefill_done()`, `decode_started()` and `finish()` so the queue model (predicted prefill time
   of dispatched requests per prefill instance, placed requests per decode instance) stays current between
   polls. `report_failure()` marks an instance down until its next successful poll. `begin()` also tells the
   replica tracker and the store recency (`mooncaked.sched.replicas`, `.store_recency`) where the prompt's blocks
   are used; a background sender (`mooncaked.kv.spare_marks`) passes the tracker's spare marks to the stores.
3. `stop()` cancels the followers, pollers and sender and awaits them; the RPC clients belong to the caller.

Owner of the shadow index, the per-instance states, the in-flight table and the live predictors. All of it is
rebuilt from the stores' dumps, the workers' LOAD replies and new measurements when the conductor restarts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mooncaked.config import Config, InstanceConfig
from mooncaked.kv import messages as kv_msg
from mooncaked.kv.spare_marks import SpareMarkSender
from mooncaked.roles.base import PeerClients
from mooncaked.roles.live_predictors import LivePredictors
from mooncaked.roles.messages import LOAD, LoadReply, LoadRequest
from mooncaked.roles.store_follower import FollowerSettings, StoreFollower
from mooncaked.rpc import RpcError
from mooncaked.sched.admission import rejects_at_arrival, select_decode
from mooncaked.sched.algorithm import SchedulerPolicy, schedule
from mooncaked.sched.replicas import BlockCosts, ReplicaTracker
from mooncaked.sched.shadow_index import ShadowIndex
from mooncaked.sched.store_recency import StoreRecency
from mooncaked.sched.types import (
    REASON_DECODE_FULL, REASON_NO_DECODE, REASON_NO_PREFILL, REASON_TBT_SLO, REASON_TTFT_SLO,
    DecodeInstanceView, Placement, PolicyConfig, PrefillInstanceView, Rejection, RequestInfo,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClusterViewSettings:
    """From the conductor's config section (conductor.view_settings)."""

    poll_interval_s: float  # LOAD polls of every prefill/decode instance
    poll_timeout_s: float  # one LOAD or store STATS call
    startup_timeout_s: float  # longest wait in start() for the first dumps and polls
    follower: FollowerSettings
    spare_marks_interval_s: float = 0.5  # replication by_reuse: how often spare marks go to the stores


@dataclass
class WorkerState:
    instance: InstanceConfig
    store_id: str  # the store on its host ("" when none is configured)
    max_num_running: int
    default_max_context_tokens: int  # until the first LOAD reply tells the real page count
    load: LoadReply | None = None
    is_up: bool = False
    last_error: str = ""
    has_polled: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class InFlight:
    request_id: str
    prefill_instance: str  # "" when prefilled inline on the decode instance
    decode_instance: str
    predicted_prefill_s: float
    dispatched_at: float
    ready_at: float  # predicted decode start
    num_context_tokens: int
    is_prefilled: bool = False
    decode_started_at: float | None = None


class ClusterView:
    """See the module docstring. Owns the index, the followers, the worker states and the in-flight table."""

    def __init__(self, config: Config, peers: PeerClients, policy_config: PolicyConfig,
                 predictors: LivePredictors, settings: ClusterViewSettings) -> None:
        self.config = config
        self.peers = peers
        self.policy_config = policy_config
        self.predictors = predictors
        self.settings = settings
        self.block_size = config.kv.block_size
        self.index = ShadowIndex()
        self.followers = {s.name: StoreFollower(s, peers.for_instance(s), self.index, settings.follower)
                          for s in config.instances_of("store")}
        self.replicas = ReplicaTracker(policy_config, self.index)
        self.recency = StoreRecency(self.index) if policy_config.tie_break == "coldest_store" else None
        self.spare_marks = SpareMarkSender(
            self.replicas, lambda name: self.followers[name].client if name in self.followers else None,
            lambda: BlockCosts.from_predictors(self.predictors.current, self.block_size), time.monotonic,
            interval_s=settings.spare_marks_interval_s, timeout_s=settings.poll_timeout_s)
        self.prefill = {i.name: self._worker_state(i) for i in config.instances_of("prefill")}
        self.decode = {i.name: self._worker_state(i) for i in config.instances_of("decode")}
        self._in_flight: dict[str, InFlight] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.prefix_blocks = {"reused_local": 0, "reused_remote": 0, "computed": 0}  # this conductor's requests

    def _worker_state(self, instance: InstanceConfig) -> WorkerState:
        store = self.config.store_for_host(instance.host)
        section = self.config.role_section(instance)
        return WorkerState(instance, store.name if store else "", section.max_batch_size,
                           section.num_kv_pages * self.block_size)

    @property
    def workers(self) -> list[WorkerState]:
        return [*self.prefill.values(), *self.decode.values()]

    async def start(self) -> None:
        for name, follower in self.followers.items():
            self.index.add_store(name)
            self._tasks.append(asyncio.create_task(follower.run(), name=f"follow-{name}"))
        for worker in self.workers:
            self._tasks.append(asyncio.create_task(self._poll(worker), name=f"load-{worker.instance.name}"))
        if self.replicas.is_active:
            self._tasks.append(asyncio.create_task(self.spare_marks.run(), name="spare-marks"))
        first_round = [f.has_tried.wait() for f in self.followers.values()]
        first_round += [w.has_polled.wait() for w in self.workers]
        try:
            await asyncio.wait_for(asyncio.gather(*first_round), self.settings.startup_timeout_s)
        except TimeoutError:
            logger.warning("cluster view: not every store and worker answered within %.1f s; serving with "
                           "what answered", self.settings.startup_timeout_s)

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- load polling -------------------------------------------------------------------------------------
    async def _poll(self, worker: WorkerState) -> None:
        client = self.peers.for_instance(worker.instance)
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                reply = await client.call(LOAD, LoadRequest(), timeout_s=self.settings.poll_timeout_s)
            except Exception as exc:  # down until a poll succeeds again
                if not isinstance(exc, RpcError):
                    logger.exception("LOAD from %s failed unexpectedly", worker.instance.name)
                self.report_failure(worker.instance.name, str(exc))
            else:
                self._loaded(worker, reply)
            worker.has_polled.set()
            await asyncio.sleep(max(self.settings.poll_interval_s - (loop.time() - started), 0.0))

    def _loaded(self, worker: WorkerState, reply: LoadReply) -> None:
        if not worker.is_up:
            logger.info("%s %s is up", worker.instance.role, worker.instance.name)
        worker.load, worker.is_up, worker.last_error = reply, True, ""
        if worker.instance.role == "decode" and reply.num_running > 0 and reply.step_time_s > 0:
            self.predictors.add_decode(reply.num_running, reply.num_context_tokens, reply.step_time_s)

    def report_failure(self, instance_name: str, reason: str) -> None:
        """Mark an instance down (a failed poll or request leg) until a LOAD call succeeds again."""
        worker = self.prefill.get(instance_name) or self.decode.get(instance_name)
        if worker is None:
            return
        if worker.is_up:
            logger.warning("%s %s is down: %s", worker.instance.role, instance_name, reason)
        worker.is_up, worker.last_error = False, reason

    # ---- placement ----------------------------------------------------------------------------------------
    def policy(self) -> SchedulerPolicy:
        return SchedulerPolicy(self.policy_config, self.predictors.current)

    def place(self, request: RequestInfo, now: float) -> Placement | Rejection:
        """Where the request runs; see the module docstring. `prefill_instance` "" means inline prefill."""
        decode_views = [self._decode_view(w, now) for w in self.decode.values()]
        if not self.prefill:
            return self._place_inline(request, decode_views, now, max_uncached=None)
        prefill_views = [self._prefill_view(w, now) for w in self.prefill.values()]
        result = schedule(request, prefill_views, decode_views, self.index, self.policy(), now)
        if isinstance(result, Rejection):
            if result.reason != REASON_NO_PREFILL:
                return result
            inline = self._place_inline(request, decode_views, now, max_uncached=self._inline_max)
            return inline if isinstance(inline, Placement) else result
        decode = self.decode[result.decode_instance]
        if self._uncached_tokens(request, decode.store_id) <= self._inline_max(decode):
            return self._place_inline(request, [self._decode_view(decode, now)], now, max_uncached=None)
        return result

    def _inline_max(self, worker: WorkerState) -> int:
        return int(self.config.role_section(worker.instance).inline_prefill_max_tokens)

    def _uncached_tokens(self, request: RequestInfo, store_id: str) -> int:
        num_blocks = self.index.prefix_lengths(request.block_keys).get(store_id, 0)
        return request.num_prompt_tokens - min(num_blocks * self.block_size, request.num_prompt_tokens - 1)

    def _place_inline(self, request: RequestInfo, decode_views: list[DecodeInstanceView], now: float,
                      max_uncached: Callable[[WorkerState], int] | None) -> Placement | Rejection:
        """Prefill on the decode instance (the colocated path): decode choice and admission as Algorithm 1."""
        config, predictors = self.policy_config, self.predictors.current
        choice = select_decode(request.num_prompt_tokens, decode_views, config, predictors.decode, now, now)
        if choice.view is None:
            return Rejection(request.request_id, REASON_NO_DECODE)
        decode = self.decode[choice.view.instance_id]
        if max_uncached is not None and self._uncached_tokens(request, decode.store_id) > max_uncached(decode):
            return Rejection(request.request_id, REASON_NO_PREFILL)
        num_blocks = self.index.prefix_lengths(request.block_keys).get(decode.store_id, 0)
        num_prefix_tokens = min(num_blocks * self.block_size, request.num_prompt_tokens - 1)
        prefill_s = predictors.prefill.predict(request.num_prompt_tokens, num_prefix_tokens)
        tbt_s = choice.predicted_tbt_s
        if config.admission != "none":
            if prefill_s > config.ttft_slo_s:
                return Rejection(request.request_id, REASON_TTFT_SLO, prefill_s, tbt_s)
            if rejects_at_arrival(config) and not choice.has_room:
                return Rejection(request.request_id, REASON_DECODE_FULL, prefill_s, tbt_s)
            if rejects_at_arrival(config) and tbt_s > config.tbt_slo_s * config.decode_load_threshold:
                return Rejection(request.request_id, REASON_TBT_SLO, prefill_s, tbt_s)
        return Placement(request.request_id, "", decode.instance.name, num_blocks, num_blocks, None, 0,
                         0.0, 0.0, prefill_s, prefill_s, tbt_s)

    def _prefill_view(self, worker: WorkerState, now: float) -> PrefillInstanceView:
        name = worker.instance.name
        pending = sorted((f for f in self._in_flight.values() if f.prefill_instance == name and not f.is_prefilled),
                         key=lambda f: f.dispatched_at)
        busy_until = pending[0].dispatched_at + pending[0].predicted_prefill_s if pending else 0.0
        queued_s = sum(f.predicted_prefill_s for f in pending[1:])
        num_queued = len(pending)
        if worker.load is not None and worker.load.num_queued_tokens > 0:  # other conductors' requests too
            queued_s = max(queued_s, self.predictors.current.prefill.predict(worker.load.num_queued_tokens, 0))
            num_queued = max(num_queued, worker.load.num_waiting)
        coldest_use = self.recency.coldest_use(worker.store_id) if self.recency is not None else 0.0
        return PrefillInstanceView(name, worker.store_id, busy_until, queued_s, num_queued, worker.is_up, coldest_use)

    def _decode_view(self, worker: WorkerState, now: float) -> DecodeInstanceView:
        mine = [f for f in self._in_flight.values() if f.decode_instance == worker.instance.name]
        running = [f for f in mine if f.decode_started_at is not None]
        started_at = [f.decode_started_at or now for f in running]
        tokens = [f.num_context_tokens for f in running]
        num_running, num_context_tokens = len(mine), sum(f.num_context_tokens for f in mine)
        max_context_tokens = worker.default_max_context_tokens
        load = worker.load
        if load is not None:
            max_context_tokens = load.num_pages * self.block_size
            num_others = load.num_running - len(running)
            if num_others > 0:  # requests of other conductors: assume they just started
                other_tokens = max(load.num_context_tokens - sum(tokens), 0) // num_others
                started_at += [now] * num_others
                tokens += [other_tokens] * num_others
            num_running = max(num_running, load.num_running + load.num_waiting)
            num_context_tokens = max(num_context_tokens, load.num_context_tokens)
        incoming = tuple((f.ready_at, f.num_context_tokens) for f in mine if f.decode_started_at is None)
        return DecodeInstanceView(worker.instance.name, worker.store_id, num_running, num_context_tokens,
                                  worker.max_num_running, max_context_tokens, tuple(started_at), tuple(tokens),
                                  incoming, worker.is_up)

    # ---- the queue model ----------------------------------------------------------------------------------
    def begin(self, request: RequestInfo, placement: Placement, now: float) -> None:
        worker = self.prefill.get(placement.prefill_instance) or self.decode.get(placement.decode_instance)
        if worker is not None and worker.store_id:
            self.replicas.note_use(worker.store_id, request.block_keys, placement.num_prefix_blocks, now)
            if self.recency is not None:
                self.recency.note_use(worker.store_id, request.block_keys, now)
        self._in_flight[request.request_id] = InFlight(
            request.request_id, placement.prefill_instance, placement.decode_instance,
            placement.predicted_prefill_s, now, now + placement.predicted_ttft_s, request.num_prompt_tokens,
            is_prefilled=not placement.prefill_instance)

    def prefill_done(self, request_id: str) -> None:
        flight = self._in_flight.get(request_id)
        if flight is not None:
            flight.is_prefilled = True

    def decode_started(self, request_id: str, now: float) -> None:
        flight = self._in_flight.get(request_id)
        if flight is not None:
            flight.is_prefilled, flight.decode_started_at = True, now

    def finish(self, request_id: str) -> None:
        self._in_flight.pop(request_id, None)

    def record_prefix(self, *, num_local: int, num_remote: int, num_computed: int) -> None:
        self.prefix_blocks["reused_local"] += num_local
        self.prefix_blocks["reused_remote"] += num_remote
        self.prefix_blocks["computed"] += num_computed

    def num_waiting(self) -> tuple[int, int]:
        """(requests waiting for or in prefill, requests placed on decode that have not started decoding)."""
        flights = self._in_flight.values()
        return (sum(1 for f in flights if not f.is_prefilled),
                sum(1 for f in flights if f.decode_started_at is None))

    # ---- GET /v1/cluster ----------------------------------------------------------------------------------
    async def describe(self) -> dict[str, Any]:
        stats = await asyncio.gather(*(self._store_stats(f) for f in self.followers.values()))
        stores = [{"name": f.store.name, "host": f.store.host, "is_up": f.is_up, "last_seq": f.last_seq,
                   "num_resyncs": f.num_resyncs, "num_indexed_blocks": self.index.num_blocks(f.store.name),
                   "stats": s, "last_error": f.last_error} for f, s in zip(self.followers.values(), stats)]
        prefill_waiting, decode_incoming = self.num_waiting()
        return {
            "instances": [self._describe_worker(w) for w in self.workers],
            "stores": stores,
            "prefix_blocks": dict(self.prefix_blocks),
            "index": {"num_keys": self.index.num_keys, "stale_stores": sorted(self.index.stale_stores())},
            "in_flight": {"total": len(self._in_flight), "prefill_waiting": prefill_waiting,
                          "decode_incoming": decode_incoming},
            "scheduler": {"policy": self.policy_config.scheduler, "admission": self.policy_config.admission,
                          "num_predictor_refits": self.predictors.num_refits,
                          "num_predictor_samples": self.predictors.num_samples()},
        }

    def _describe_worker(self, worker: WorkerState) -> dict[str, Any]:
        load = worker.load
        return {"name": worker.instance.name, "role": worker.instance.role, "host": worker.instance.host,
                "port": worker.instance.port, "store": worker.store_id, "is_up": worker.is_up,
                "last_error": worker.last_error,
                "load": None if load is None else {
                    "num_running": load.num_running, "num_waiting": load.num_waiting,
                    "num_queued_tokens": load.num_queued_tokens, "num_free_pages": load.num_free_pages,
                    "num_pages": load.num_pages, "step_time_s": load.step_time_s,
                    "num_context_tokens": load.num_context_tokens}}

    async def _store_stats(self, follower: StoreFollower) -> dict[str, int] | None:
        if not follower.is_up:
            return None
        try:
            reply = await follower.client.call(kv_msg.STATS, kv_msg.StatsRequest(),
                                               timeout_s=self.settings.poll_timeout_s)
        except RpcError:
            return None
        return dict(reply.counters)
