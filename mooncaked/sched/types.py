"""Plain data the scheduling policy reads and returns (no behaviour, no I/O).

1. The owner of the live state (the conductor, or the simulator) builds one `PrefillInstanceView` per prefill
   instance and one `DecodeInstanceView` per decode instance, and a `RequestInfo` per request.
2. `mooncaked.sched.algorithm.schedule` returns a `Placement` or a `Rejection` with a reason.
3. The owner acts on it (reserve, prefill, fetch the remote prefix) and updates its own state.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass

from mooncaked.sched.decode_memory import DecodeHold

# Rejection reasons.
REASON_TTFT_SLO = "ttft_slo"
REASON_TBT_SLO = "tbt_slo"
REASON_DECODE_FULL = "decode_full"
REASON_NO_PREFILL = "no_prefill_instance"
REASON_NO_DECODE = "no_decode_instance"
REASON_DECODE_REFUSED = "decode_refused_after_prefill"  # admission "baseline": prefill work wasted


@dataclass(frozen=True)
class RequestInfo:
    """One request as the scheduler sees it. `block_keys` are the prompt's full-block prefix keys, in order.
    `max_tokens` (0: unknown) sizes the KV pages a decode instance holds for it; `predicted_output_tokens` (0: none)
    is the output-length predictor's forecast, which prediction-based rejection uses for its decode time.
    `num_sequences`: a parallel sampling's sequences (n, best_of), each a batch slot, sharing their prompt's full
    blocks' pages on the decode instance (sched/decode_memory.py num_pages_for)."""

    request_id: str
    num_prompt_tokens: int
    block_keys: tuple[Hashable, ...]
    arrival_time: float = 0.0
    max_tokens: int = 0
    predicted_output_tokens: int = 0
    num_sequences: int = 1


@dataclass(frozen=True)
class PipelineSpec:
    """A prefill group as the scheduler sees it: each stage's prefill coefficients (PrefillTimePredictor's, in
    stage order), the chunk size, and the seconds to hand one chunk's hidden states from stage s to s+1."""

    stage_coefficients: tuple[tuple[float, ...], ...]
    chunk_tokens: int
    handoff_s: tuple[float, ...] = ()  # one per stage boundary; missing ones count as 0

    def __post_init__(self) -> None:
        if len(self.stage_coefficients) < 2:
            raise ValueError(f"a pipeline needs at least 2 stages, got {len(self.stage_coefficients)}")
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}")
        if any(len(c) != 6 for c in self.stage_coefficients):
            raise ValueError("every stage needs the 6 coefficients of a PrefillTimePredictor")
        values = [v for c in self.stage_coefficients for v in c] + list(self.handoff_s)
        if not all(math.isfinite(v) for v in values) or any(h < 0 for h in self.handoff_s):
            raise ValueError("stage coefficients must be finite and handoffs finite and >= 0")


@dataclass(frozen=True)
class PrefillInstanceView:
    """A prefill instance's load. `store_id` names the store on its host (the shadow index answers per store).

    `busy_until` is when its current prefill finishes (<= now when idle); `queued_prefill_s` is the sum of the
    predicted prefill times of the requests waiting behind it (the owner adds a request's prediction when it
    queues it and subtracts it when it starts). `prefill_coefficients`: the instance's own fitted prefill model
    (empty: the policy's). `overhead_s`: what a request spends there besides queueing and compute (KV
    planning, write confirmation, RPC), added to its TTFT. A prefill group is one view (named by its first
    stage) with a `pipeline`: its prefill time follows the pipeline, its queue is the group's.
    """

    instance_id: str
    store_id: str
    busy_until: float = 0.0
    queued_prefill_s: float = 0.0
    num_queued: int = 0
    is_available: bool = True
    prefill_coefficients: tuple[float, ...] = ()
    overhead_s: float = 0.0
    coldest_use: float = 0.0  # last use of its store's least recently used block (`mooncaked.sched.store_recency`)
    pipeline: PipelineSpec | None = None  # a prefill group (its first stage's id): predicted by sched/pipeline.py
    device_id: str = ""  # its device prefix cache's id in the device index ("": none reported)
    # (store id, bytes per second) measured by this instance's recent fetches from that store: the link's rate
    # in the transfer-time estimate instead of the configured scheduler.link_gbps
    fetch_bandwidth: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class DecodeInstanceView:
    """A decode instance's batch. Totals cover the running batch only (what a load probe sees now).

    `running_started_at[i]` / `running_tokens[i]`: decode start time and current context of running request i
    (used by prediction-based early rejection). `incoming`: (predicted decode start, context tokens) of requests
    already placed here whose prefill is still in progress. With output-length prediction the owner also gives
    `running_ends_at[i]` (predicted end of running request i) and `incoming_decode_s[j]` (predicted decode time
    of incoming request j); without, every request decodes for the policy's uniform `decode_time_s`.
    `step_coefficients`: the instance's own fitted decode step model (empty: the policy's).
    Inline prefill on this instance (sched/inline.py): it takes prompts whose uncached part is at most
    `inline_max_tokens` (0: none); `prefill_coefficients` is its own fitted prefill model (empty: the policy's),
    `inline_wait_s` the predicted wait for its compute thread, `inline_overhead_s` what an inline prefill spends
    there besides that wait and the forward. `num_pages` (0: unknown) and `page_holds`: its KV pages, and every
    sequence's pages over its predicted life (sched/decode_memory.py), for prediction-based rejection.
    """

    instance_id: str
    store_id: str
    num_running: int
    num_context_tokens: int
    max_num_running: int
    max_context_tokens: int
    running_started_at: tuple[float, ...] = ()
    running_tokens: tuple[int, ...] = ()
    incoming: tuple[tuple[float, int], ...] = ()
    is_available: bool = True
    running_ends_at: tuple[float, ...] = ()
    incoming_decode_s: tuple[float, ...] = ()
    step_coefficients: tuple[float, ...] = ()
    inline_max_tokens: int = 0
    prefill_coefficients: tuple[float, ...] = ()
    inline_wait_s: float = 0.0
    inline_overhead_s: float = 0.0
    num_pages: int = 0
    page_holds: tuple[DecodeHold, ...] = ()
    device_id: str = ""  # its device prefix cache's id in the device index ("": none reported)


@dataclass(frozen=True)
class Placement:
    """Where a request runs. When `fetch_from_store` is set, the prefill instance first pulls
    `num_fetch_blocks` blocks (block indices `num_local_prefix_blocks` .. `num_prefix_blocks - 1`) from that store
    into its own: this is the transfer of Algorithm 1 line 21 and the hot-spot replication of section 4.2."""

    request_id: str
    prefill_instance: str
    decode_instance: str
    num_prefix_blocks: int
    num_local_prefix_blocks: int
    fetch_from_store: str | None
    num_fetch_blocks: int
    predicted_transfer_s: float
    predicted_queue_s: float
    predicted_prefill_s: float
    predicted_ttft_s: float
    predicted_tbt_s: float
    decode_defer_s: float = 0.0  # the decode starts this long after the predicted TTFT (sched/admission.py)

    @property
    def predicted_decode_start_s(self) -> float:
        """Seconds from placement to the predicted decode start."""
        return self.predicted_ttft_s + self.decode_defer_s


@dataclass(frozen=True)
class Rejection:
    """A refused request (HTTP 429). `reason` is one of the REASON_* constants."""

    request_id: str
    reason: str
    predicted_ttft_s: float = 0.0
    predicted_tbt_s: float = 0.0


SCHEDULERS = ("kvcache_centric", "cache_aware", "load_balancing", "random")
ADMISSION_POLICIES = ("none", "baseline", "early_rejection", "early_rejection_predicted")
REPLICATION_MODES = ("always", "by_reuse")
TIE_BREAKS = ("first", "coldest_store")


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs of the scheduling policy (the conductor's `scheduler:` config section and the simulator's).

    scheduler: prefill placement, one of SCHEDULERS. admission: one of ADMISSION_POLICIES.
    kvcache_balancing_threshold: fetch the best remote prefix when it is more than this many times longer than
    the instance's local one (Algorithm 1 lines 5 and 20). decode_time_s: the uniform decode time t_d of
    prediction-based early rejection. decode_load_threshold: accepted predicted TBT / TBT SLO.
    replication: what becomes of the extra copies of a block (`mooncaked.sched.replicas`): `always` keeps every
    copy as a full replica (the paper); `by_reuse` keeps the copy on the store that last used the block and marks
    the others spare (evicted first), unless the block's reuse pays for a second copy. heat_half_life_s: half-life
    of a block's use count (its heat). replica_displaced_reuse: the assumed chance that the block a replica
    displaces would have been reused; a second copy is kept when heat x transfer time of a block >= this x its
    recompute time. tie_break: among instances with equal predicted TTFT, `first` (the paper) or `coldest_store`:
    the one whose store's least recently used block was used longest ago. cpp_min_tokens: prompts of more
    tokens may go to a prefill group (a view with a `pipeline`) when it predicts the lower TTFT.
    """

    scheduler: str = "kvcache_centric"
    admission: str = "early_rejection"
    kvcache_balancing_threshold: float = 1.2
    ttft_slo_s: float = 30.0
    tbt_slo_s: float = 0.1
    block_size: int = 512
    decode_time_s: float = 5.0
    decode_load_threshold: float = 1.0
    seed: int = 0
    replication: str = "always"
    heat_half_life_s: float = 60.0
    replica_displaced_reuse: float = 0.5
    tie_break: str = "first"
    cpp_min_tokens: int = 0
    max_decode_defer_s: float = 0.0  # early_rejection_predicted: longest decode-start deferral (sched/admission.py)

    def __post_init__(self) -> None:
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {', '.join(SCHEDULERS)}, got {self.scheduler!r}")
        if self.admission not in ADMISSION_POLICIES:
            raise ValueError(f"admission must be one of {', '.join(ADMISSION_POLICIES)}, got {self.admission!r}")
        if self.kvcache_balancing_threshold < 1.0:
            raise ValueError(f"kvcache_balancing_threshold must be >= 1, got {self.kvcache_balancing_threshold}")
        if self.ttft_slo_s <= 0 or self.tbt_slo_s <= 0:
            raise ValueError("ttft_slo_s and tbt_slo_s must be positive")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.decode_time_s <= 0 or self.decode_load_threshold <= 0:
            raise ValueError("decode_time_s and decode_load_threshold must be positive")
        if self.replication not in REPLICATION_MODES:
            raise ValueError(f"replication must be one of {', '.join(REPLICATION_MODES)}, got {self.replication!r}")
        if self.tie_break not in TIE_BREAKS:
            raise ValueError(f"tie_break must be one of {', '.join(TIE_BREAKS)}, got {self.tie_break!r}")
        if self.cpp_min_tokens < 0:
            raise ValueError(f"cpp_min_tokens must be >= 0, got {self.cpp_min_tokens}")
        if not self.heat_half_life_s > 0 or not self.replica_displaced_reuse >= 0:
            raise ValueError("heat_half_life_s must be positive and replica_displaced_reuse >= 0")
