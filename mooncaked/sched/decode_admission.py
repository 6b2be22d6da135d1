"""Whether a decode instance takes a request, per admission policy (paper section 4.3): the one rule that the
decode role and the simulator both run.

1. `capacity_refusal`: a request whose pages exceed the instance's whole KV is refused at once, by every policy
   (waiting would never help).
2. RESERVE (`reserve_refusal`): the hard limits (free KV pages, batch slots) always; the TBT SLO, predicted with
   the instance's own fitted step model, only under `early_rejection` (`early_rejection_predicted` leaves the
   TBT forecast to the conductor, which predicts the batch at the request's decode start, sched/admission.py).
3. Under `none` and `baseline` (`WAITING_POLICIES`) nothing is refused for load: a request over the hard limits
   waits for room, bounded by a deadline (the decode role's RESERVE call, the simulator's waiting queue).
4. Under `baseline` the decode instance checks its load only when the prefilled request arrives
   (`refusal_after_prefill`): a refusal then wastes the prefill (section 4.3.2).
5. `rejection_reason`: the reason the conductor (and the simulator) records for a refusal: `decode_` and the
   refusal's first word (`decode_memory`, `decode_batch`, `decode_tbt_slo`).

Pure: no I/O, no clock; the caller passes the instance's load now.
"""

from __future__ import annotations

from dataclasses import dataclass

from mooncaked.sched.predictors import DecodeStepPredictor
from mooncaked.sched.types import REASON_DECODE_REFUSED

WAITING_POLICIES = ("none", "baseline")
# A DECODE whose reservation got no pages by its deadline (a forecast was wrong): the conductor moves the request
REASON_PAGES_NOT_FREED = "pages_not_freed"


@dataclass(frozen=True)
class DecodeLoadNow:
    """The instance's load as RESERVE sees it: reservations count as running."""

    num_free_pages: int  # free, less the pages reservations set aside
    num_seqs: int  # running sequences and reservations
    num_context_tokens: int  # the running batch's context and the reserved prompts


@dataclass(frozen=True)
class StepLimit:
    """The TBT check: the fitted step model (None before any fit: `fallback_step_s` per sequence) and the SLO."""

    model: DecodeStepPredictor | None
    fallback_step_s: float  # the decode loop's recent mean step time
    tbt_slo_s: float

    def predict(self, num_seqs: int, num_context_tokens: int) -> float:
        if self.model is not None:
            return self.model.predict(num_seqs, num_context_tokens)
        return self.fallback_step_s * num_seqs / max(num_seqs - 1, 1)


def capacity_refusal(num_pages: int, num_pages_total: int) -> str:
    """Why the request can never fit this instance ("" when it can)."""
    if num_pages > num_pages_total:
        return f"memory: needs {num_pages} KV pages, the instance has {num_pages_total}"
    return ""


def reserve_refusal(admission: str, load: DecodeLoadNow, num_pages: int, num_prompt_tokens: int,
                    max_batch_size: int, limit: StepLimit, num_seqs: int = 1) -> str:
    """Why RESERVE cannot take the request (of `num_seqs` sequences: parallel sampling) now ("" when it can); a
    reason starts with memory, batch or tbt_slo."""
    if num_pages > load.num_free_pages:
        return f"memory: needs {num_pages} KV pages, {load.num_free_pages} free"
    if load.num_seqs + num_seqs > max_batch_size:
        return f"batch: {load.num_seqs} sequences running or reserved, {num_seqs} more (max_batch_size)"
    if admission != "early_rejection":
        return ""
    step_s = limit.predict(load.num_seqs + num_seqs, load.num_context_tokens + num_prompt_tokens * num_seqs)
    if step_s > limit.tbt_slo_s:
        return f"tbt_slo: predicted step {step_s * 1000:.0f} ms > {limit.tbt_slo_s * 1000:.0f} ms"
    return ""


def refusal_after_prefill(admission: str, num_running: int, num_context_tokens: int, num_prompt_tokens: int,
                          limit: StepLimit) -> str:
    """`baseline` only: the load check when the prefilled request arrives ("" when it is admitted)."""
    if admission != "baseline":
        return ""
    step_s = limit.predict(num_running + 1, num_context_tokens + num_prompt_tokens)
    if step_s > limit.tbt_slo_s:
        return f"{REASON_DECODE_REFUSED}: predicted step {step_s * 1000:.0f} ms > {limit.tbt_slo_s * 1000:.0f} ms"
    return ""


def rejection_reason(refusal: str) -> str:
    """The recorded reason of a decode instance's refusal: `decode_` and the refusal's first word."""
    return "decode_" + (refusal.partition(":")[0] or "refused")
