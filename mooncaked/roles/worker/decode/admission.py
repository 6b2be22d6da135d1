"""Whether a decode instance takes a request, per admission policy: the simulator's meanings (paper section 6).

1. RESERVE (`reserve_refusal`): the hard limits (KV pages, batch slots) always; the TBT SLO, predicted with the
   instance's own fitted step model (the one it reports to conductors), only under `early_rejection`
   (`early_rejection_predicted` leaves the TBT forecast to the conductor, which predicts the batch at the
   request's decode start).
2. Under `none` and `baseline` nothing is refused for load: a request over the hard limits waits for room
   (`Room.wait_until`), bounded by its call's deadline.
3. Under `baseline` the decode instance checks its load only when the prefilled request arrives
   (`refusal_after_prefill`): a refusal then wastes the prefill, as in the simulator.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from mooncaked.sched.predictors import DecodeStepPredictor
from mooncaked.sched.types import REASON_DECODE_REFUSED

WAITING_POLICIES = ("none", "baseline")


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


def reserve_refusal(admission: str, load: DecodeLoadNow, num_pages: int, num_prompt_tokens: int,
                    max_batch_size: int, limit: StepLimit) -> str:
    """Why RESERVE cannot take the request now ("" when it can); a reason starts with memory, batch or tbt_slo."""
    if num_pages > load.num_free_pages:
        return f"memory: needs {num_pages} KV pages, {load.num_free_pages} free"
    if load.num_seqs >= max_batch_size:
        return f"batch: {load.num_seqs} sequences running or reserved (max_batch_size)"
    if admission != "early_rejection":
        return ""
    step_s = limit.predict(load.num_seqs + 1, load.num_context_tokens + num_prompt_tokens)
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


class Room:
    """Wakes RESERVE calls waiting for KV pages or a batch slot (owned by the DecodeRole)."""

    def __init__(self) -> None:
        self._changed = asyncio.Condition()

    async def freed(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def wait_until(self, refusal: Callable[[], str], timeout_s: float) -> str:
        """Wait until `refusal()` is "" or `timeout_s` runs out; returns the last refusal ("" once there is room)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        async with self._changed:
            while reason := refusal():
                left_s = deadline - loop.time()
                if left_s <= 0:
                    return reason
                try:
                    await asyncio.wait_for(self._changed.wait(), left_s)
                except TimeoutError:
                    return refusal()
            return ""
