"""Prometheus metrics of one mooncaked process, on its own registry (several can live in one test process).

1. A role makes one `Metrics()` at start and hands its groups to the components that record into them:
   `requests` (conductor: latencies, outcomes, rejections, tokens), `queues` (conductor and workers),
   `engine` (prefill and decode workers: batch size, step time), `cache` (prefix reuse, transfers, store),
   `predictions` (conductor: relative error of predicted TTFT and TBT against what happened), `tenants`
   (conductor: requests, tokens and rejections per tenant; tenant ids come from the tenants file only, so the
   label's values are bounded).
2. Components record with the groups' methods; label values that form a closed set are checked.
3. GET /metrics serves `render()` with `CONTENT_TYPE`.
Every name starts with `mooncaked_`; times are in seconds, sizes in bytes (Prometheus conventions).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Buckets after vLLM's, widened at the low end for CPU-sized models and at the high end for long prompts.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 30.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # 30 s: the default TTFT SLO
TPOT_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                  7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS_S = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
QUEUE_BUCKETS_S = (0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0, 600.0)
STEP_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0,
                  10.0, 30.0)
# Relative error (predicted - actual) / actual: -1 is "predicted zero", +1 is "predicted twice the actual".
RELATIVE_ERROR_BUCKETS = (-0.75, -0.5, -0.35, -0.25, -0.15, -0.1, -0.05, 0.0, 0.05, 0.1, 0.15, 0.25, 0.35, 0.5,
                          0.75, 1.0, 2.0, 4.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)

REQUEST_STATUSES = frozenset({"ok", "rejected", "failed", "cancelled", "timeout", "invalid"})
PHASES = frozenset({"prefill", "decode"})
LOCATIONS = frozenset({"local", "remote"})
DIRECTIONS = frozenset({"read", "write"})
TIERS = frozenset({"dram", "ssd"})


def _check(label: str, value: str, allowed: frozenset[str]) -> None:
    if value not in allowed:
        raise ValueError(f"metric label {label}={value!r}: expected one of {sorted(allowed)}")


class RequestMetrics:
    """Per-request latencies and outcomes, recorded where requests finish (the conductor)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.ttft_seconds = Histogram("mooncaked_time_to_first_token_seconds", "Time to first token.",
                                      buckets=TTFT_BUCKETS_S, registry=registry)
        self.tpot_seconds = Histogram("mooncaked_time_per_output_token_seconds",
                                      "Per request: (e2e - ttft) / (output tokens - 1).",
                                      buckets=TPOT_BUCKETS_S, registry=registry)
        self.e2e_seconds = Histogram("mooncaked_e2e_request_latency_seconds", "Arrival to last token.",
                                     buckets=E2E_BUCKETS_S, registry=registry)
        self.requests_total = Counter("mooncaked_requests", "Finished requests by outcome.", ["status"],
                                      registry=registry)
        self.rejections_total = Counter("mooncaked_rejections", "Requests rejected, by reason.", ["reason"],
                                        registry=registry)
        self.prompt_tokens_total = Counter("mooncaked_prompt_tokens", "Prompt tokens of admitted requests.",
                                           registry=registry)
        self.generation_tokens_total = Counter("mooncaked_generation_tokens", "Generated tokens.",
                                               registry=registry)
        self.migrations_total = Counter("mooncaked_migrations", "Requests placed again after a leg failed, by cause.",
                                        ["cause"], registry=registry)

    def observe_finished(self, *, status: str, ttft_s: float | None, e2e_s: float, num_output_tokens: int) -> None:
        _check("status", status, REQUEST_STATUSES)
        self.requests_total.labels(status=status).inc()
        self.e2e_seconds.observe(e2e_s)
        self.generation_tokens_total.inc(num_output_tokens)
        if ttft_s is not None:
            self.ttft_seconds.observe(ttft_s)
            if num_output_tokens > 1:
                self.tpot_seconds.observe((e2e_s - ttft_s) / (num_output_tokens - 1))

    def observe_migration(self, cause: str) -> None:
        """`cause`: the failed leg and how, e.g. decode_lost, prefill_deadline."""
        self.migrations_total.labels(cause=cause).inc()

    def observe_rejection(self, reason: str) -> None:
        """Count a rejected request (instead of `observe_finished`); `reason` names the check that failed,
        e.g. ttft_slo, tbt_slo, memory, no_instance."""
        self.rejections_total.labels(reason=reason).inc()
        self.requests_total.labels(status="rejected").inc()


class QueueMetrics:
    """Queue lengths and times by queue name (e.g. prefill, decode, transfer)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.length = Gauge("mooncaked_queue_length", "Requests waiting in a queue.", ["queue"], registry=registry)
        self.time_seconds = Histogram("mooncaked_queue_time_seconds", "Time a request waited in a queue.",
                                      ["queue"], buckets=QUEUE_BUCKETS_S, registry=registry)

    def set_length(self, queue: str, num_waiting: int) -> None:
        self.length.labels(queue=queue).set(num_waiting)

    def observe_wait(self, queue: str, wait_s: float) -> None:
        self.time_seconds.labels(queue=queue).observe(wait_s)


class EngineMetrics:
    """Batch sizes and step times of a worker, by phase (prefill or decode)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.batch_size = Histogram("mooncaked_batch_size", "Requests in one model step.", ["phase"],
                                    buckets=BATCH_SIZE_BUCKETS, registry=registry)
        self.batch_tokens = Histogram("mooncaked_batch_tokens", "Tokens in one model step.", ["phase"],
                                      buckets=tuple(float(2**i) for i in range(17)), registry=registry)
        self.step_seconds = Histogram("mooncaked_step_time_seconds", "Duration of one model step.", ["phase"],
                                      buckets=STEP_BUCKETS_S, registry=registry)

    def observe_step(self, phase: str, *, num_requests: int, num_tokens: int, step_s: float) -> None:
        _check("phase", phase, PHASES)
        self.batch_size.labels(phase=phase).observe(num_requests)
        self.batch_tokens.labels(phase=phase).observe(num_tokens)
        self.step_seconds.labels(phase=phase).observe(step_s)


class CacheMetrics:
    """Prefix reuse, KV bytes moved, and the store's usage and evictions by tier."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.blocks_reused_total = Counter("mooncaked_prefix_blocks_reused", "Prompt blocks served from cache.",
                                           ["location"], registry=registry)
        self.device_blocks_total = Counter("mooncaked_device_prefix_blocks",
                                           "Prompt blocks read in place from this instance's device prefix cache "
                                           "(also counted as reused, location local).", registry=registry)
        self.device_cached_blocks = Gauge("mooncaked_device_cached_blocks",
                                          "Blocks held in this instance's device prefix cache.", registry=registry)
        self.blocks_computed_total = Counter("mooncaked_prefix_blocks_computed",
                                             "Prompt blocks computed (not in any cache).", registry=registry)
        self.transfer_bytes_total = Counter("mooncaked_transfer_bytes", "KV bytes moved by the transfer engine.",
                                            ["direction"], registry=registry)
        self.store_used_bytes = Gauge("mooncaked_store_used_bytes", "Bytes held by the store.", ["tier"],
                                      registry=registry)
        self.store_capacity_bytes = Gauge("mooncaked_store_capacity_bytes", "Store capacity.", ["tier"],
                                          registry=registry)
        self.store_blocks = Gauge("mooncaked_store_blocks", "Blocks held by the store.", ["tier"], registry=registry)
        self.evictions_total = Counter("mooncaked_evictions", "Blocks evicted from a tier.", ["tier"],
                                       registry=registry)

    def observe_prefix(self, *, num_local: int, num_remote: int, num_computed: int) -> None:
        self.blocks_reused_total.labels(location="local").inc(num_local)
        self.blocks_reused_total.labels(location="remote").inc(num_remote)
        self.blocks_computed_total.inc(num_computed)

    def observe_device_prefix(self, *, num_blocks: int, num_cached: int) -> None:
        """A prompt read `num_blocks` from the device tier, which now holds `num_cached` blocks."""
        self.device_blocks_total.inc(num_blocks)
        self.device_cached_blocks.set(num_cached)

    def observe_transfer(self, direction: str, num_bytes: int) -> None:
        _check("direction", direction, DIRECTIONS)
        self.transfer_bytes_total.labels(direction=direction).inc(num_bytes)

    def set_store_usage(self, tier: str, *, used_bytes: int, capacity_bytes: int, num_blocks: int) -> None:
        _check("tier", tier, TIERS)
        self.store_used_bytes.labels(tier=tier).set(used_bytes)
        self.store_capacity_bytes.labels(tier=tier).set(capacity_bytes)
        self.store_blocks.labels(tier=tier).set(num_blocks)

    def observe_evictions(self, tier: str, num_blocks: int) -> None:
        _check("tier", tier, TIERS)
        self.evictions_total.labels(tier=tier).inc(num_blocks)


class PredictionMetrics:
    """How far the scheduler's predictions were from what happened, per served request."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.ttft_error = Histogram("mooncaked_ttft_prediction_relative_error",
                                    "(predicted - actual) / actual time to first token, per served request.",
                                    buckets=RELATIVE_ERROR_BUCKETS, registry=registry)
        self.tbt_error = Histogram("mooncaked_tbt_prediction_relative_error",
                                   "(predicted - actual) / actual time between tokens, per served request.",
                                   buckets=RELATIVE_ERROR_BUCKETS, registry=registry)

    def observe(self, *, ttft_error: float, tbt_error: float | None) -> None:
        self.ttft_error.observe(ttft_error)
        if tbt_error is not None:
            self.tbt_error.observe(tbt_error)


class TenantMetrics:
    """Per-tenant use, labelled by the ids of the tenants file."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests_total = Counter("mooncaked_tenant_requests", "Finished requests by tenant and outcome.",
                                      ["tenant", "status"], registry=registry)
        self.tokens_total = Counter("mooncaked_tenant_tokens", "Tokens by tenant: prompt, cached (prompt tokens "
                                    "served from KVCache) and generated.", ["tenant", "kind"], registry=registry)
        self.rejections_total = Counter("mooncaked_tenant_rejections", "Requests rejected (429) by tenant and "
                                        "reason; rate_limit: the tenant's own limits.", ["tenant", "reason"],
                                        registry=registry)
        self.pool_bytes = Gauge("mooncaked_tenant_pool_bytes", "Bytes a tenant's blocks hold in a store, by tier "
                                "(stores).", ["tenant", "tier"], registry=registry)
        self._pool_labels: set[tuple[str, str]] = set()

    def set_pool_bytes(self, tier: str, bytes_by_tenant: dict[str, int]) -> None:
        """The store's bytes per tenant in `tier`, replacing the last values (blocks of no tenant are left out)."""
        _check("tier", tier, TIERS)
        for tenant, seen_tier in self._pool_labels:  # tenants whose blocks are gone read 0, not their last value
            if seen_tier == tier and tenant not in bytes_by_tenant:
                self.pool_bytes.labels(tenant=tenant, tier=tier).set(0)
        for tenant, num_bytes in bytes_by_tenant.items():
            if tenant:
                self.pool_bytes.labels(tenant=tenant, tier=tier).set(num_bytes)
                self._pool_labels.add((tenant, tier))

    def observe_finished(self, tenant: str, *, status: str, num_prompt_tokens: int, num_cached_tokens: int,
                         num_output_tokens: int) -> None:
        _check("status", status, REQUEST_STATUSES)
        self.requests_total.labels(tenant=tenant, status=status).inc()
        self.tokens_total.labels(tenant=tenant, kind="prompt").inc(num_prompt_tokens)
        self.tokens_total.labels(tenant=tenant, kind="cached").inc(num_cached_tokens)
        self.tokens_total.labels(tenant=tenant, kind="generated").inc(num_output_tokens)

    def observe_rejection(self, tenant: str, reason: str) -> None:
        self.rejections_total.labels(tenant=tenant, reason=reason).inc()


class Metrics:
    """Owns one process's registry and every metric group on it."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = RequestMetrics(self.registry)
        self.queues = QueueMetrics(self.registry)
        self.engine = EngineMetrics(self.registry)
        self.cache = CacheMetrics(self.registry)
        self.predictions = PredictionMetrics(self.registry)
        self.tenants = TenantMetrics(self.registry)
        self.reservations_waited_total = Counter(
            "mooncaked_reservations_waited", "DECODE calls whose reservation found no KV pages free and waited in "
            "the page queue.", registry=self.registry)
        self.page_wait_timeouts_total = Counter(
            "mooncaked_page_wait_timeouts", "DECODE calls whose reservation got no KV pages by its deadline (a "
            "forecast was wrong: the conductor moves the request).", registry=self.registry)
        self.role_switches_total = Counter("mooncaked_role_switches", "Role switches of this instance (P/D ratio "
                                           "controller).", ["from_role", "to_role"], registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
