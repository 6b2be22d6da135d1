"""Metrics by request class (interactive: the HTTP routes; batch: Batch API lines), on the conductor's registry.

1. `ClassMetrics(metrics)` registers its series on the conductor's `Metrics` registry (metrics.py stays the
   class-blind set every role shares).
2. A request's run calls `observe_finished` when it settles; for the batch class, `rejected` counts deferrals:
   the line was refused for load, waits and runs again (a batch line is never answered 429).
3. The batch queue's lengths are read at scrape time (`set_batch_queue`).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from mooncaked.runtime.metrics import E2E_BUCKETS_S, REQUEST_STATUSES, TPOT_BUCKETS_S, TTFT_BUCKETS_S, Metrics
from mooncaked.sched.priority import BATCH, INTERACTIVE


class ClassMetrics:
    """Owns the per-class series (registered on the borrowed Metrics registry)."""

    def __init__(self, metrics: Metrics) -> None:
        registry = metrics.registry
        self.requests_total = Counter("mooncaked_class_requests", "Finished requests by class and outcome.",
                                      ["request_class", "status"], registry=registry)
        self.ttft_seconds = Histogram("mooncaked_class_time_to_first_token_seconds", "Time to first token by class.",
                                      ["request_class"], buckets=TTFT_BUCKETS_S, registry=registry)
        self.tpot_seconds = Histogram("mooncaked_class_time_per_output_token_seconds",
                                      "Per request: (e2e - ttft) / (output tokens - 1), by class.",
                                      ["request_class"], buckets=TPOT_BUCKETS_S, registry=registry)
        self.e2e_seconds = Histogram("mooncaked_class_e2e_request_latency_seconds", "Arrival to last token, by class.",
                                     ["request_class"], buckets=E2E_BUCKETS_S, registry=registry)
        self.batch_lines = Gauge("mooncaked_batch_lines", "Batch lines in the conductor's queue, by state.",
                                 ["state"], registry=registry)
        self.batch_preemptions_total = Counter("mooncaked_batch_preemptions",
                                               "Running batch lines preempted for interactive work.",
                                               registry=registry)

    def observe_finished(self, *, is_batch: bool, status: str, ttft_s: float | None, e2e_s: float,
                         num_output_tokens: int) -> None:
        assert status in REQUEST_STATUSES, status
        request_class = BATCH if is_batch else INTERACTIVE
        self.requests_total.labels(request_class=request_class, status=status).inc()
        if status == "rejected":
            return
        self.e2e_seconds.labels(request_class=request_class).observe(e2e_s)
        if ttft_s is not None:
            self.ttft_seconds.labels(request_class=request_class).observe(ttft_s)
            if num_output_tokens > 1:
                self.tpot_seconds.labels(request_class=request_class).observe(
                    (e2e_s - ttft_s) / (num_output_tokens - 1))

    def set_batch_queue(self, *, num_waiting: int, num_running: int) -> None:
        self.batch_lines.labels(state="waiting").set(num_waiting)
        self.batch_lines.labels(state="running").set(num_running)
