"""The conductor's view of the cluster: which store holds which block, how loaded each worker is, who is up.

1. `start()` registers every configured store with the shadow index and starts, per store, a `StoreFollower`
   (full dump, then the store's event stream; a gap, a lost event window or a broken connection makes it dump
   again) and, per prefill/decode instance, a LOAD poller (`WorkerHealth.poll`, worker_health.py: every
   `poll_interval_s`, each call with its own deadline). It returns once every store was dumped and every worker
   polled once (or `startup_timeout_s` passed), so a restarted conductor places its first request on a fresh
   index.
2. Per request the backend calls `place()` (placement.py: Algorithm 1 over the live views, or an inline
   placement on a decode instance when no prefill instance is configured or the prompt's uncached part is small
   enough; a prefill group is one candidate, its first stage, available only while every member is up), then
   `begin()`, `prefill_done()`, `decode_started()` and `finish()` so the queue model (predicted prefill time
   of dispatched requests per prefill instance, placed requests per decode instance) stays current between
   polls. `health` (worker_health.py) keeps each worker up or down: `health.report_failure()` marks an instance
   down until its next successful poll and calls what watches it (`health.watch_down`); every LOAD reply brings
   the instance's own fitted performance model, which `place()` predicts with (predictors.py), and its device
   prefix cache's changes into the device index (one "store" per instance, by instance name), which Algorithm 1
   reads for the local prefix. Finished requests teach the output-length predictor, which forecasts each decode
   instance's batch. A placement also tells the replica tracker and the store recency (`mooncaked.sched.replicas`,
   `.store_recency`) where the prompt's blocks are used; a background sender (spare_marks.py) passes the
   tracker's spare marks to the stores.
3. Membership changes (membership.py) arrive while serving: a joining store gets a follower, a joining worker a
   poller; one that leaves has them cancelled; one that is not `ready` (starting, draining) is polled but
   receives no new work; one whose role changed is removed and added again under its new role.
4. Followers, pollers and the sender are supervised tasks (runtime/supervised.py: an unexpected exception is
   logged and the task restarts). `stop()` cancels them and awaits them; the RPC clients belong to the caller.

Owner of the shadow index, the device index, the per-instance states, the in-flight table, the live predictors
and the output-length predictor. All but the last are rebuilt from the stores' dumps and the workers' LOAD
replies when the conductor restarts; the output-length predictor starts again from its conservative prior
(max_tokens).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass

from mooncaked.cluster.membership import Membership, MemberRecord, StaticMembership, store_on_host
from mooncaked.config import Config, InstanceConfig
from mooncaked.roles.base import PeerClients
from mooncaked.roles.conductor.placement import Placer
from mooncaked.roles.conductor.view.fetch_rates import FetchRates
from mooncaked.roles.conductor.view.in_flight import InFlightTable
from mooncaked.roles.conductor.view.instances import OutputForecast, WorkerState
from mooncaked.roles.conductor.view.predictors import LivePredictors
from mooncaked.roles.conductor.view.spare_marks import SpareMarkSender
from mooncaked.roles.conductor.view.store_follower import FollowerSettings, StoreFollower
from mooncaked.roles.conductor.view.worker_health import WorkerHealth
from mooncaked.runtime.supervised import start_supervised
from mooncaked.sched.output_length import OutputLengthPredictor
from mooncaked.sched.replicas import BlockCosts, ReplicaTracker
from mooncaked.sched.shadow_index import ShadowIndex
from mooncaked.sched.store_recency import StoreRecency
from mooncaked.sched.types import Placement, PolicyConfig, Rejection, RequestInfo

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClusterViewSettings:
    """From the conductor's config section (conductor.view_settings)."""

    poll_interval_s: float  # LOAD polls of every prefill/decode instance
    poll_timeout_s: float  # one LOAD or store STATS call
    startup_timeout_s: float  # longest wait in start() for the first dumps and polls
    follower: FollowerSettings
    spare_marks_interval_s: float = 0.5  # replication by_reuse: how often spare marks go to the stores


class ClusterView:
    """See the module docstring. Owns the index, the followers, the worker states, the in-flight table (`flights`),
    the live predictors and the output-length predictor; `health` updates the worker states, the device index and
    the predictors from the polls. GET /v1/cluster renders it (cluster_info.py)."""

    def __init__(self, config: Config, peers: PeerClients, policy_config: PolicyConfig,
                 predictors: LivePredictors, settings: ClusterViewSettings,
                 membership: Membership | None = None) -> None:
        self.config = config
        self.membership = membership or StaticMembership(config)
        self.peers = peers
        self.run_id = secrets.randbits(62) + 1  # this process's run: decode instances drop an earlier run's orphans
        self.policy_config = policy_config
        self.predictors = predictors
        self.settings = settings
        self.block_size = config.kv.block_size
        self.index = ShadowIndex()
        self.device_index = ShadowIndex()  # each worker's device prefix cache, by instance name
        self.followers: dict[str, StoreFollower] = {}
        self.prefill: dict[str, WorkerState] = {}
        self.decode: dict[str, WorkerState] = {}
        self.known: dict[str, InstanceConfig] = {}  # every instance seen, for the legs of requests placed on it
        self.flights = InFlightTable()
        self._tasks: list[asyncio.Task[None]] = []
        self.replicas = ReplicaTracker(policy_config, self.index)
        self.recency = StoreRecency(self.index) if policy_config.tie_break == "coldest_store" else None
        self.spare_marks = SpareMarkSender(
            self.replicas, lambda name: self.followers[name].client if name in self.followers else None,
            lambda: BlockCosts.from_predictors(self.predictors.current, self.block_size), time.monotonic,
            interval_s=settings.spare_marks_interval_s, timeout_s=settings.poll_timeout_s)
        section = config.scheduler
        self.output_lengths = OutputLengthPredictor(quantile=section.output_length_quantile)
        self.forecast = OutputForecast(self.output_lengths, config.conductor.default_max_tokens,
                                       section.predict_output_length)
        self._member_tasks: dict[str, asyncio.Task[None]] = {}
        self._is_started = False
        for record in self.membership.members().values():
            self._add_member(record)
        self.prefix_blocks = {"reused_local": 0, "reused_remote": 0, "computed": 0}  # this conductor's requests
        # prefill groups by their first stage (which takes PREFILL); the other members are no candidates
        self.groups = {group.members[0]: group for group in config.cluster.prefill_groups}
        self.later_stages = {member for group in config.cluster.prefill_groups for member in group.members[1:]}
        self.fetch_rates = FetchRates()
        self.health = WorkerHealth(peers, self.run_id, self.prefill, self.decode, self.groups, self.device_index,
                                   predictors, poll_interval_s=settings.poll_interval_s,
                                   poll_timeout_s=settings.poll_timeout_s)
        self.placer = Placer(config, policy_config, predictors, self.index, self.flights, self.forecast, self.prefill,
                             self.decode, self.groups, self.later_stages, self.recency, self.device_index,
                             self.fetch_rates)

    def _worker_state(self, instance: InstanceConfig) -> WorkerState:
        store = store_on_host(self.membership, instance.host)
        section = self.config.role_section(instance)
        # until its first LOAD reply: a page count sized from a memory budget is known only to the worker, which
        # refuses to start without room for one request of max_model_len tokens
        pages = section.num_kv_pages
        tokens = pages * self.block_size if pages is not None else self.config.model.max_model_len
        return WorkerState(instance, store.name if store else "", section.max_batch_size, tokens)

    @property
    def workers(self) -> list[WorkerState]:
        return [*self.prefill.values(), *self.decode.values()]

    async def start(self) -> None:
        self._is_started = True
        if self.replicas.is_active:
            self._tasks.append(start_supervised("spare-marks", self.spare_marks.run))
        for name in [*self.followers, *self.prefill, *self.decode]:
            self._start_member_task(name)
        self.membership.add_listener(self._on_member)
        first_round = [f.has_tried.wait() for f in self.followers.values()]
        first_round += [w.has_polled.wait() for w in self.workers]
        try:
            await asyncio.wait_for(asyncio.gather(*first_round), self.settings.startup_timeout_s)
        except TimeoutError:
            logger.warning("cluster view: not every store and worker answered within %.1f s; serving with "
                           "what answered", self.settings.startup_timeout_s)

    async def stop(self) -> None:
        self._is_started = False
        tasks, self._tasks = self._tasks + list(self._member_tasks.values()), []
        self._member_tasks = {}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- membership -------------------------------------------------------------------------------------
    def instance_config(self, name: str) -> InstanceConfig:
        """The instance a request's leg goes to (also one that left since the request was placed)."""
        instance = self.known.get(name)
        if instance is None:
            raise KeyError(f"no instance named {name!r} is known to this conductor")
        return instance

    def _on_member(self, name: str, old: MemberRecord | None, new: MemberRecord | None) -> None:
        if old is not None and (new is None or (old.role, old.host, old.port, old.incarnation)
                                != (new.role, new.host, new.port, new.incarnation)):
            self._remove_member(name)
        if new is None:
            return
        worker = self.prefill.get(name) or self.decode.get(name)
        if worker is not None:
            if worker.state != new.state:
                logger.info("%s %s is %s", new.role, name, new.state)
            worker.state = new.state
        elif name not in self.followers and self._add_member(new):
            logger.info("%s %s joined (%s:%d, %s)", new.role, name, new.host, new.port, new.state)
            self._start_member_task(name)

    def _add_member(self, record: MemberRecord) -> bool:
        instance = record.instance_config()
        if record.role == "store":
            self.known[record.name] = instance
            self.followers[record.name] = StoreFollower(instance, self.peers.for_instance(instance), self.index,
                                                        self.settings.follower)
            for worker in self.workers:
                if worker.instance.host == record.host and not worker.store_id:
                    worker.store_id = record.name
            return True
        if record.role not in ("prefill", "decode"):
            return False
        self.known[record.name] = instance
        worker = self._worker_state(instance)
        worker.state = record.state
        (self.prefill if record.role == "prefill" else self.decode)[record.name] = worker
        return True

    def _start_member_task(self, name: str) -> None:
        if not self._is_started:
            return
        follower = self.followers.get(name)
        if follower is not None:
            self.index.add_store(name)
            self._member_tasks[name] = start_supervised(f"follow-{name}", follower.run)
            return
        worker = self.prefill.get(name) or self.decode.get(name)
        if worker is not None:
            self._member_tasks[name] = start_supervised(f"load-{name}", lambda: self.health.poll(worker))

    def _remove_member(self, name: str) -> None:
        task = self._member_tasks.pop(name, None)
        if task is not None:
            task.cancel()
            self._tasks.append(task)  # awaited by stop()
            self._tasks = [t for t in self._tasks if not t.done()]
        if self.followers.pop(name, None) is not None:
            self.index.remove_store(name)
            for worker in self.workers:
                if worker.store_id == name:
                    store = store_on_host(self.membership, worker.instance.host)
                    worker.store_id = store.name if store is not None and store.name != name else ""
        was_prefill = self.prefill.pop(name, None) is not None
        self.device_index.remove_store(name)
        self.predictors.forget(name)
        self.fetch_rates.forget(name)
        if self.decode.pop(name, None) is not None or was_prefill:
            logger.info("%s left", name)

    # ---- placement ----------------------------------------------------------------------------------------
    def place(self, request: RequestInfo, now: float, excluded: frozenset[str] = frozenset()) -> Placement | Rejection:
        """Where the request runs; see the module docstring. `prefill_instance` "" means inline prefill.
        `excluded`: instances this request saw fail (a migration goes elsewhere). A placement is recorded as a
        use of the prompt's blocks on the store where it prefills."""
        result = self.placer.place(request, now, excluded)
        if isinstance(result, Placement):
            worker = self.prefill.get(result.prefill_instance) or self.decode.get(result.decode_instance)
            if worker is not None and worker.store_id:
                self.replicas.note_use(worker.store_id, request.block_keys, result.num_prefix_blocks, now)
                if self.recency is not None:
                    self.recency.note_use(worker.store_id, request.block_keys, now)
        return result

    def is_group_ready(self, first_stage: str) -> bool:
        return self.placer.is_group_ready(first_stage)

    def observe_output_length(self, max_tokens: int, num_prompt_tokens: int, client_id: str,
                              num_output_tokens: int) -> None:
        """A request that ended by itself (EOS, stop, max_tokens): a sample of the output-length predictor (a
        cancelled or failed request's length says nothing about its own end)."""
        self.output_lengths.observe(api_key=client_id, max_tokens=max_tokens, num_prompt_tokens=num_prompt_tokens,
                                    num_output_tokens=num_output_tokens)

    def record_fetch(self, instance: str, store: str, num_blocks: int, seconds: float) -> None:
        """A PREFILL on `instance` loaded `num_blocks` from `store` (another host's) in `seconds`."""
        num_bytes = num_blocks * self.predictors.current.transfer.bytes_per_block
        self.fetch_rates.observe(instance, store, num_bytes, seconds)

    def record_prefix(self, *, num_local: int, num_remote: int, num_computed: int) -> None:
        self.prefix_blocks["reused_local"] += num_local
        self.prefix_blocks["reused_remote"] += num_remote
        self.prefix_blocks["computed"] += num_computed

    def num_waiting(self) -> tuple[int, int]:
        return self.flights.num_waiting()
