"""What one request's run measured, and what it reports when it settles (request_run.py's stage 4).

1. While the run serves, its `RunRecord` takes the prefix the request reused: `observe_prefill()` after a PREFILL
   (a migrated attempt's cached tokens include streamed output, so only the first attempt's count; a fetch from
   another host's store also goes into the view's fetch rates), `observe_prefix()` for an inline prefill's DECODE.
   Each goes into the view's prefix counts and the cache metrics. `observe_tokens()` as tokens go out keeps the
   first and last token times.
2. `report()`, once, when the run settles: teach the output-length predictor a naturally ended request's length,
   record how far the first placement's predicted TTFT and TBT were from the measured ones (prediction_errors.py),
   and count the request in its tenant's and its class's metrics, and (unless rejected: that is counted when it
   happens) in the request metrics.
"""

from __future__ import annotations

import time
from typing import Protocol

from mooncaked.config import Config
from mooncaked.roles.conductor.class_metrics import ClassMetrics
from mooncaked.roles.conductor.frontend import ConductorRequest
from mooncaked.roles.conductor.view.cluster import ClusterView
from mooncaked.roles.conductor.view.prediction_errors import PredictionErrors, PredictionRecord
from mooncaked.roles.worker.messages import PrefillReply
from mooncaked.runtime.metrics import Metrics
from mooncaked.sched.types import Placement


class RecordSinks(Protocol):
    """What a run's record reports into (the conductor's backend's)."""

    config: Config
    view: ClusterView
    metrics: Metrics
    prediction_errors: PredictionErrors
    class_metrics: ClassMetrics


class RunRecord:
    """One request's measurements, owned by its RequestRun; reports into the borrowed view and metrics."""

    def __init__(self, sinks: RecordSinks, prepared: ConductorRequest) -> None:
        self.sinks = sinks
        self.prepared = prepared
        self.num_cached_tokens = 0
        self.first_token_at: float | None = None
        self.last_token_at = 0.0

    def observe_tokens(self) -> bool:
        """Tokens went out now; True when they are the request's first."""
        is_first = self.first_token_at is None
        self.last_token_at = time.monotonic()
        self.first_token_at = self.first_token_at or self.last_token_at
        return is_first

    def observe_prefill(self, reply: PrefillReply, placement: Placement | None, *, is_migrated: bool) -> None:
        if not is_migrated:
            self.observe_prefix(reply.num_cached_tokens, reply.num_fetched_blocks)
        if placement is not None and placement.fetch_from_store and reply.num_fetched_blocks and reply.fetch_s > 0:
            self.sinks.view.record_fetch(placement.prefill_instance, placement.fetch_from_store,
                                         reply.num_fetched_blocks, reply.fetch_s)

    def observe_prefix(self, num_cached_tokens: int, num_fetched_blocks: int) -> None:
        self.num_cached_tokens = min(num_cached_tokens, self.prepared.num_prompt_tokens)
        num_blocks = len(self.prepared.block_keys)
        num_cached_blocks = min(num_cached_tokens // self.sinks.config.kv.block_size, num_blocks)
        num_remote = min(num_fetched_blocks, num_cached_blocks)
        self.sinks.view.record_prefix(num_local=num_cached_blocks - num_remote, num_remote=num_remote,
                                      num_computed=num_blocks - num_cached_blocks)
        self.sinks.metrics.cache.observe_prefix(num_local=num_cached_blocks - num_remote, num_remote=num_remote,
                                                num_computed=num_blocks - num_cached_blocks)

    def report(self, *, status: str, num_output_tokens: int, first_placement: Placement | None) -> None:
        prepared, metrics = self.prepared, self.sinks.metrics
        if status == "ok":
            self.sinks.view.observe_output_length(prepared.max_tokens, prepared.num_prompt_tokens,
                                                  prepared.request.client_id, num_output_tokens)
        self._record_prediction_error(num_output_tokens, first_placement)
        tenant = prepared.request.tenant
        if tenant is not None:
            metrics.tenants.observe_finished(
                tenant.id, status=status, num_prompt_tokens=prepared.num_prompt_tokens,
                num_cached_tokens=self.num_cached_tokens, num_output_tokens=num_output_tokens)
        e2e_s = time.monotonic() - prepared.arrival_time
        ttft_s = None if self.first_token_at is None else self.first_token_at - prepared.arrival_time
        self.sinks.class_metrics.observe_finished(is_batch=prepared.request.is_batch, status=status, ttft_s=ttft_s,
                                                  e2e_s=e2e_s, num_output_tokens=num_output_tokens)
        if status != "rejected":
            metrics.requests.observe_finished(status=status, ttft_s=ttft_s, e2e_s=e2e_s,
                                              num_output_tokens=num_output_tokens)

    def _record_prediction_error(self, num_output_tokens: int, placement: Placement | None) -> None:
        if placement is None or self.first_token_at is None:
            return
        actual_tbt_s = None
        if num_output_tokens > 1:
            actual_tbt_s = (self.last_token_at - self.first_token_at) / (num_output_tokens - 1)
        self.sinks.prediction_errors.record(PredictionRecord(
            self.prepared.request_id, placement.predicted_ttft_s, self.first_token_at - self.prepared.arrival_time,
            placement.predicted_tbt_s, actual_tbt_s))
