"""Request placement: Algorithm 1 of the Mooncake journal paper (KVCache-centric scheduling) and its baselines.

Entry point, called once per request by the conductor and by the simulator:

    schedule(request: RequestInfo, prefill_views: Sequence[PrefillInstanceView],
             decode_views: Sequence[DecodeInstanceView], index: ShadowIndex,
             policy: SchedulerPolicy, now: float, device_index: ShadowIndex | None = None) -> Placement | Rejection

1. Prefix match: `index.prefix_lengths(request.block_keys)` gives every store's reusable prefix (line 3), and
   `device_index.prefix_lengths(...)` every instance's device prefix cache's (indexed by the view's `device_id`):
   an instance's local prefix is the longer of its device tier's and its host store's. Among equal TTFTs the
   instance with the longer device prefix wins (it reads the prefix in place, no copy from the store).
2. Prefill choice among the available instances, prefill groups (chunked pipeline parallelism) only for
   prompts longer than `cpp_min_tokens` (or when no single instance is available), by `policy.config.scheduler`:
   - `kvcache_centric` (lines 4-16): per instance, reuse the best prefix anywhere when it is more than
     `kvcache_balancing_threshold` times the local one (paying T_transfer for the missing blocks at the rate the
     instance measured from that store, `fetch_bandwidth`, else the configured one), else the local prefix;
     TTFT = T_transfer + T_queue + T_prefill (a group's T_prefill follows its pipeline, sched/pipeline.py); the
     smallest wins (on ties the first, or under `tie_break: coldest_store` the one whose store's coldest block
     is oldest). Departure from line 5: when that store's link is measured slower than the configured rate, the
     instance also weighs every other store passing the threshold and recomputing the missing blocks, and takes
     its smallest TTFT (the fast path, or recompute; `mooncaked.sched.prefix_plans`). With no link measured
     slow every placement is the paper's;
   - `cache_aware`: the same with local prefixes only (no transfer);
   - `load_balancing`: the smallest T_queue; `random`: a hash of the request id and seed.
3. Decode choice (line 17) and admission (lines 18-19), see `mooncaked.sched.admission`. Inline prefill on a
   decode instance, and when it replaces this placement, is `mooncaked.sched.inline`.
4. If the chosen instance reuses a remote prefix, the Placement names the source store (lines 20-21): the
   prefill instance pulls those blocks into its own store, which replicates hot blocks (section 4.2).

Pure: no I/O, no clock, no randomness beyond the request id; same inputs give the same answer.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mooncaked.sched.admission import admission_rejection, select_decode
from mooncaked.sched.decode_memory import decode_num_pages, is_decoding
from mooncaked.sched.pipeline import PipelinePredictor
from mooncaked.sched.predictors import Predictors, PrefillTimePredictor, queue_time_s
from mooncaked.sched.prefix_plans import prefix_plans
from mooncaked.sched.shadow_index import ShadowIndex
from mooncaked.sched.types import (
    REASON_NO_DECODE,
    REASON_NO_PREFILL,
    DecodeInstanceView,
    PipelineSpec,
    Placement,
    PolicyConfig,
    PrefillInstanceView,
    Rejection,
    RequestInfo,
)


@dataclass(frozen=True)
class SchedulerPolicy:
    """Everything a decision depends on besides the live views: the knobs and the predictors."""

    config: PolicyConfig
    predictors: Predictors


@dataclass(frozen=True)
class PrefillChoice:
    view: PrefillInstanceView
    num_prefix_blocks: int
    num_local_prefix_blocks: int
    fetch_from_store: str | None
    transfer_s: float
    queue_s: float
    prefill_s: float
    num_device_prefix_blocks: int = 0

    @property
    def ttft_s(self) -> float:
        return self.transfer_s + self.queue_s + self.prefill_s + self.view.overhead_s


def schedule(
    request: RequestInfo,
    prefill_views: Sequence[PrefillInstanceView],
    decode_views: Sequence[DecodeInstanceView],
    index: ShadowIndex,
    policy: SchedulerPolicy,
    now: float,
    device_index: ShadowIndex | None = None,
    excluded_stores: frozenset[str] = frozenset(),
) -> Placement | Rejection:
    """Algorithm 1 with the configured prefill scheduler and admission policy; see the module docstring.
    `excluded_stores`: stores whose blocks this request must not reuse (one failed to deliver them)."""
    candidates = eligible_prefill(request, prefill_views, policy.config)
    if not candidates:
        return Rejection(request.request_id, REASON_NO_PREFILL)
    prefix_lengths = store_prefix_lengths(index, request, excluded_stores)
    device_lengths = device_index.prefix_lengths(request.block_keys) if device_index is not None else {}
    prefill = choose_prefill(request, candidates, prefix_lengths, policy, now, device_lengths)
    config = policy.config
    ttft = prefill.ttft_s
    is_decoded = is_decoding(request.max_tokens, is_inline_prefill=False)
    decode = select_decode(request.num_prompt_tokens, decode_views, config, policy.predictors.decode, now,
                           now + ttft, num_pages=decode_pages(request, config, is_inline_prefill=False),
                           num_output_tokens=request.predicted_output_tokens,
                           num_sequences=request.num_sequences if is_decoded else 0,
                           max_defer_s=min(config.max_decode_defer_s, config.ttft_slo_s - ttft))
    if decode.view is None:
        return Rejection(request.request_id, REASON_NO_DECODE, ttft, 0.0)
    rejection = admission_rejection(request.request_id, config, ttft, decode)
    if rejection is not None:
        return rejection
    return Placement(
        request_id=request.request_id,
        prefill_instance=prefill.view.instance_id,
        decode_instance=decode.view.instance_id,
        num_prefix_blocks=prefill.num_prefix_blocks,
        num_local_prefix_blocks=prefill.num_local_prefix_blocks,
        fetch_from_store=prefill.fetch_from_store,
        num_fetch_blocks=prefill.num_prefix_blocks - prefill.num_local_prefix_blocks,
        predicted_transfer_s=prefill.transfer_s,
        predicted_queue_s=prefill.queue_s,
        predicted_prefill_s=prefill.prefill_s,
        predicted_ttft_s=ttft,
        predicted_tbt_s=decode.predicted_tbt_s,
        decode_defer_s=decode.decode_defer_s,
    )


def store_prefix_lengths(index: ShadowIndex, request: RequestInfo,
                         excluded_stores: frozenset[str]) -> dict[str, int]:
    """Every store's reusable prefix of the request (blocks), leaving out `excluded_stores`."""
    lengths = index.prefix_lengths(request.block_keys)
    return {store: n for store, n in lengths.items() if store not in excluded_stores}


def decode_pages(request: RequestInfo, config: PolicyConfig, *, is_inline_prefill: bool) -> int:
    """The KV pages a decode instance holds for `request` (0 when its max_tokens is unknown, or when it does not
    decode: sched/decode_memory.is_decoding)."""
    if not request.max_tokens:
        return 0
    return decode_num_pages(request.num_prompt_tokens, request.max_tokens, config.block_size, request.num_sequences,
                            is_inline_prefill=is_inline_prefill)


def eligible_prefill(request: RequestInfo, prefill_views: Sequence[PrefillInstanceView],
                     config: PolicyConfig) -> list[PrefillInstanceView]:
    """The available views that may take `request`: single instances, and prefill groups when the prompt is
    longer than `cpp_min_tokens`; a short prompt goes to a group only when no single instance is available."""
    available = [view for view in prefill_views if view.is_available]
    is_long = request.num_prompt_tokens > config.cpp_min_tokens
    eligible = [view for view in available if view.pipeline is None or is_long]
    return eligible or available


def choose_prefill(
    request: RequestInfo,
    candidates: Sequence[PrefillInstanceView],
    prefix_lengths: dict[str, int],
    policy: SchedulerPolicy,
    now: float,
    device_lengths: Mapping[str, int] | None = None,
) -> PrefillChoice:
    """The prefill instance under `policy.config.scheduler` (candidates must be non-empty and available);
    `device_lengths`: the device prefix caches' prefix lengths, by device id."""
    scheduler = policy.config.scheduler
    device_lengths = device_lengths or {}
    if scheduler == "kvcache_centric":
        return _best_ttft(request, candidates, prefix_lengths, policy, now, allow_fetch=True,
                          device_lengths=device_lengths)
    if scheduler == "cache_aware":
        return _best_ttft(request, candidates, prefix_lengths, policy, now, allow_fetch=False,
                          device_lengths=device_lengths)
    if scheduler == "load_balancing":
        view = min(candidates, key=lambda v: queue_time_s(v, now))
    else:
        seed = f"{policy.config.seed}:{request.request_id}".encode()
        view = candidates[zlib.crc32(seed) % len(candidates)]
    device_len = device_prefix(view, device_lengths)
    choice = _local_choice(request, view, max(prefix_lengths.get(view.store_id, 0), device_len), policy, now)
    return dataclasses.replace(choice, num_device_prefix_blocks=device_len)


def device_prefix(view: PrefillInstanceView, device_lengths: Mapping[str, int]) -> int:
    """Leading prompt blocks the instance's device prefix cache holds (0 when it reports none)."""
    return device_lengths.get(view.device_id, 0) if view.device_id else 0


def _best_ttft(
    request: RequestInfo,
    candidates: Sequence[PrefillInstanceView],
    prefix_lengths: dict[str, int],
    policy: SchedulerPolicy,
    now: float,
    allow_fetch: bool,
    device_lengths: Mapping[str, int],
) -> PrefillChoice:
    threshold = policy.config.kvcache_balancing_threshold
    is_coldest_first = policy.config.tie_break == "coldest_store"
    sources = prefix_lengths if allow_fetch else {}
    # many instances share a prefix length and a model: predict once each
    prefill_s_by: dict[tuple[int, tuple[float, ...], PipelineSpec | None], float] = {}
    best: PrefillChoice | None = None
    for view in candidates:
        device_len = device_prefix(view, device_lengths)
        local_len = max(prefix_lengths.get(view.store_id, 0), device_len)  # the device tier, then the host's store
        queue_s = queue_time_s(view, now)
        plans = prefix_plans(local_len, sources, dict(view.fetch_bandwidth), threshold, policy.predictors.transfer)
        for plan in plans:  # the paper's first: it wins ties (sched/prefix_plans.py)
            model_key = (plan.num_prefix_blocks, view.prefill_coefficients, view.pipeline)
            prefill_s = prefill_s_by.get(model_key)
            if prefill_s is None:
                prefill_s = prefill_model(view, policy).predict(
                    request.num_prompt_tokens, _prefix_tokens(request, plan.num_prefix_blocks, policy))
                prefill_s_by[model_key] = prefill_s
            ttft_s = plan.transfer_s + queue_s + prefill_s + view.overhead_s
            is_tie = best is not None and ttft_s == best.ttft_s
            if best is None or ttft_s < best.ttft_s or (is_tie and device_len > best.num_device_prefix_blocks) or (
                is_tie and device_len == best.num_device_prefix_blocks and is_coldest_first
                and view.coldest_use < best.view.coldest_use
            ):
                best = PrefillChoice(view, plan.num_prefix_blocks, local_len, plan.source, plan.transfer_s,
                                     queue_s, prefill_s, device_len)
    assert best is not None
    return best


def prefill_model(view: PrefillInstanceView, policy: SchedulerPolicy) -> PrefillTimePredictor | PipelinePredictor:
    """A group's pipeline; else the instance's own fitted model when it reported one, else the policy's."""
    if view.pipeline is not None:
        return PipelinePredictor(view.pipeline)
    if view.prefill_coefficients:
        return PrefillTimePredictor(view.prefill_coefficients)
    return policy.predictors.prefill


def _local_choice(
    request: RequestInfo, view: PrefillInstanceView, local_len: int, policy: SchedulerPolicy, now: float
) -> PrefillChoice:
    prefill_s = prefill_model(view, policy).predict(request.num_prompt_tokens,
                                                    _prefix_tokens(request, local_len, policy))
    return PrefillChoice(view, local_len, local_len, None, 0.0, queue_time_s(view, now), prefill_s)


def _prefix_tokens(request: RequestInfo, num_blocks: int, policy: SchedulerPolicy) -> int:
    return prefix_tokens(request.num_prompt_tokens, num_blocks, policy.config.block_size)


def prefix_tokens(num_prompt_tokens: int, num_blocks: int, block_size: int) -> int:
    """Reused tokens: whole blocks, at most all but the last prompt token (that one is always computed)."""
    return min(num_blocks * block_size, max(num_prompt_tokens - 1, 0))
