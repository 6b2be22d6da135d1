"""Placement over the conductor's live views: Algorithm 1, or an inline prefill on a decode instance.

1. The ClusterView builds one `Placer` at its start, over the worker states, shadow index, in-flight table and
   predictors it owns (the worker dicts change in place as members join and leave).
2. Per request `ClusterView.place()` calls `Placer.place()`: it turns every worker state into an instance view
   (a prefill group is one candidate, its first stage, available only while every member is up), runs
   `schedule()` and, when no prefill instance is configured, none can take the request, or the prompt's uncached
   part is small enough, places it inline on a decode instance instead.
3. Nothing to stop: the placer holds no task and no state of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from mooncaked.config import Config, PrefillGroupConfig
from mooncaked.roles.conductor.view.in_flight import InFlightTable
from mooncaked.roles.conductor.view.instances import (OutputForecast, WorkerState, decode_view, inline_wait_s,
                                                      pipeline_spec, prefill_view)
from mooncaked.roles.conductor.view.predictors import LivePredictors
from mooncaked.sched.admission import rejects_at_arrival, select_decode
from mooncaked.sched.algorithm import SchedulerPolicy, schedule
from mooncaked.sched.pipeline import even_pipeline
from mooncaked.sched.shadow_index import ShadowIndex
from mooncaked.sched.store_recency import StoreRecency
from mooncaked.sched.types import (
    REASON_DECODE_FULL, REASON_NO_DECODE, REASON_NO_PREFILL, REASON_TBT_SLO, REASON_TTFT_SLO,
    DecodeInstanceView, PipelineSpec, Placement, PolicyConfig, PrefillInstanceView, Rejection, RequestInfo,
)


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

    @property
    def block_size(self) -> int:
        return self.config.kv.block_size

    def policy(self) -> SchedulerPolicy:
        return SchedulerPolicy(self.policy_config, self.predictors.current)

    def place(self, request: RequestInfo, now: float, excluded: frozenset[str]) -> Placement | Rejection:
        """Where the request runs (see the module docstring); `prefill_instance` "" means inline prefill."""
        decode_views = [self._decode_view(w, now, excluded) for w in self.decode.values()]
        if not self.prefill:
            return self._place_inline(request, decode_views, now, max_uncached=None)
        prefill_views = [self._prefill_view(w, now, excluded) for w in self.prefill.values()
                         if w.instance.name not in self.later_stages]
        result = schedule(request, prefill_views, decode_views, self.index, self.policy(), now)
        if isinstance(result, Rejection):
            if result.reason != REASON_NO_PREFILL:
                return result
            inline = self._place_inline(request, decode_views, now, max_uncached=self._inline_max)
            return inline if isinstance(inline, Placement) else result
        decode = self.decode[result.decode_instance]
        if self._uncached_tokens(request, decode.store_id) <= self._inline_max(decode):
            return self._place_inline(request, [self._decode_view(decode, now, excluded)], now, max_uncached=None)
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
        prefill_s = self.predictors.prefill_for(decode.instance.name).predict(request.num_prompt_tokens,
                                                                              num_prefix_tokens)
        tbt_s = choice.predicted_tbt_s
        wait_s = inline_wait_s(decode, self.flights.on_decode(decode.instance.name), self.predictors, now)
        ttft_s = wait_s + prefill_s + (decode.load.overhead_s if decode.load is not None else 0.0)
        if config.admission != "none":
            if ttft_s > config.ttft_slo_s:
                return Rejection(request.request_id, REASON_TTFT_SLO, ttft_s, tbt_s)
            if rejects_at_arrival(config) and not choice.has_room:
                return Rejection(request.request_id, REASON_DECODE_FULL, ttft_s, tbt_s)
            if rejects_at_arrival(config) and tbt_s > config.tbt_slo_s * config.decode_load_threshold:
                return Rejection(request.request_id, REASON_TBT_SLO, ttft_s, tbt_s)
        return Placement(request.request_id, "", decode.instance.name, num_blocks, num_blocks, None, 0,
                         0.0, 0.0, prefill_s, ttft_s, tbt_s)

    def _prefill_view(self, worker: WorkerState, now: float, excluded: frozenset[str]) -> PrefillInstanceView:
        name = worker.instance.name
        view = prefill_view(worker, self.flights.on_prefill(name), self.predictors, now)
        if self.recency is not None:
            view = dataclasses.replace(view, coldest_use=self.recency.coldest_use(worker.store_id))
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
        name = worker.instance.name
        view = decode_view(worker, self.flights.on_decode(name), self.predictors, self.forecast, self.block_size, now)
        return dataclasses.replace(view, is_available=False) if name in excluded else view
