"""Placement over the conductor's live views: Algorithm 1, or an inline prefill on a decode instance.

1. The ClusterView builds one `Placer` at its start, over the worker states, shadow index, in-flight table and
   predictors it owns (the worker dicts change in place as members join and leave).
2. Per request `ClusterView.place()` calls `Placer.place()`: it turns every worker state into an instance view
   (a prefill group is one candidate, its first stage, available only while every member is up; a decode
   instance's view carries what an inline prefill there would cost) and runs `sched.inline.place`: Algorithm 1,
   or an inline prefill on a decode instance.
3. Nothing to stop: the placer holds no task and no state of its own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mooncaked.config import Config, PrefillGroupConfig
from mooncaked.roles.conductor.view.fetch_rates import FetchRates
from mooncaked.roles.conductor.view.in_flight import InFlightTable
from mooncaked.roles.conductor.view.instances import (OutputForecast, WorkerState, decode_view, inline_wait_s,
                                                      pipeline_spec, prefill_view)
from mooncaked.roles.conductor.view.predictors import LivePredictors
from mooncaked.sched.algorithm import SchedulerPolicy
from mooncaked.sched.inline import place
from mooncaked.sched.pipeline import even_pipeline
from mooncaked.sched.shadow_index import ShadowIndex
from mooncaked.sched.store_recency import StoreRecency
from mooncaked.sched.types import (DecodeInstanceView, PipelineSpec, Placement, PolicyConfig, PrefillInstanceView,
                                   Rejection, RequestInfo)


@dataclass(frozen=True)
class Placer:
    """Owns nothing: reads the worker states, index, in-flight table and predictors that the ClusterView owns."""

    config: Config
    policy_config: PolicyConfig
    predictors: LivePredictors
    index: ShadowIndex
    flights: InFlightTable
    forecast: OutputForecast
    prefill: dict[str, WorkerState]
    decode: dict[str, WorkerState]
    groups: dict[str, PrefillGroupConfig]  # by first stage (which takes PREFILL)
    later_stages: set[str]  # the other members of a group: no candidates
    recency: StoreRecency | None
    device_index: ShadowIndex | None = None  # the workers' device prefix caches, by instance name
    fetch_rates: FetchRates | None = None  # measured prefix fetches: each link's rate in the transfer estimate

    @property
    def block_size(self) -> int:
        return self.config.kv.block_size

    def policy(self) -> SchedulerPolicy:
        return SchedulerPolicy(self.policy_config, self.predictors.current)

    def place(self, request: RequestInfo, now: float, excluded: frozenset[str]) -> Placement | Rejection:
        """Where the request runs (`sched.inline.place`); `prefill_instance` "" means inline prefill."""
        decode_views = [self._decode_view(w, now, excluded) for w in self.decode.values()]
        prefill_views = [self._prefill_view(w, now, excluded) for w in self.prefill.values()
                         if w.instance.name not in self.later_stages]
        return place(request, prefill_views, decode_views, self.index, self.policy(), now, self.device_index,
                     excluded)  # a store among them failed to deliver a prefix: its blocks are not reused

    def _prefill_view(self, worker: WorkerState, now: float, excluded: frozenset[str]) -> PrefillInstanceView:
        name = worker.instance.name
        view = prefill_view(worker, self.flights.on_prefill(name), self.predictors, now)
        if self.device_index is not None:
            view = dataclasses.replace(view, device_id=name)
        if self.recency is not None:
            view = dataclasses.replace(view, coldest_use=self.recency.coldest_use(worker.store_id))
        if self.fetch_rates is not None:
            view = dataclasses.replace(view, fetch_bandwidth=self.fetch_rates.for_instance(name))
        if name in self.groups:
            view = dataclasses.replace(view, pipeline=self._group_pipeline(worker),
                                       is_available=view.is_available and self.is_group_ready(name))
        return dataclasses.replace(view, is_available=False) if name in excluded else view

    def _group_pipeline(self, first_stage: WorkerState) -> PipelineSpec:
        """The pipeline the group's first stage reports, else (no stage model fitted yet) the default whole-model
        predictor split evenly over the stages."""
        reported = pipeline_spec(first_stage.load)
        if reported is not None:
            return reported
        num_stages = len(self.groups[first_stage.instance.name].members)
        chunk_tokens = int(self.config.role_section(first_stage.instance).cpp_chunk_tokens)
        return even_pipeline(self.predictors.current.prefill, num_stages, chunk_tokens)

    def is_group_ready(self, first_stage: str) -> bool:
        """Every member of the group is up and ready: until a member is back, the group takes nothing."""
        group = self.groups[first_stage]
        members = [self.prefill.get(name) for name in group.members]
        return all(member is not None and member.is_placeable for member in members)

    def _decode_view(self, worker: WorkerState, now: float, excluded: frozenset[str]) -> DecodeInstanceView:
        """The instance's batch, and what an inline prefill there would cost: its wait for the compute thread,
        its own prefill model, its overhead."""
        name = worker.instance.name
        flights = self.flights.on_decode(name)
        view = decode_view(worker, flights, self.predictors, self.forecast, self.block_size, now)
        view = dataclasses.replace(
            view, inline_max_tokens=int(self.config.role_section(worker.instance).inline_prefill_max_tokens),
            prefill_coefficients=self.predictors.prefill_for(name).coefficients,
            inline_wait_s=inline_wait_s(worker, flights, self.predictors, now),
            inline_overhead_s=worker.load.overhead_s if worker.load is not None else 0.0,
            device_id=name if self.device_index is not None else "")
        return dataclasses.replace(view, is_available=False) if name in excluded else view
