"""Request classes and priorities: the order of every queue, and when a batch line may start (issue 15).

1. Two classes: interactive (the HTTP completion routes) and batch (lines of a Batch API batch). `queue_rank`
   orders a queue by class (interactive first), then `priority` (lower first, as in vLLM), then arrival: the
   prefill queue of a prefill instance, the RESERVE calls waiting for room on a decode instance, and the
   conductor's queue of batch lines.
2. `batch_admission` decides whether the next batch line starts now: only while fewer than `max_in_flight` run,
   no interactive request was rejected within the back-off, and the placement it would get predicts a TTFT and
   a TBT under `margin` times their SLOs, so interactive work keeps its headroom. Batch lines are never
   rejected: one that may not start waits.
Pure policy over plain data with `now` passed in.
"""

from __future__ import annotations

from dataclasses import dataclass

from mooncaked.sched.types import Placement, PolicyConfig, Rejection

INTERACTIVE = "interactive"
BATCH = "batch"
REQUEST_CLASSES = (INTERACTIVE, BATCH)


def queue_rank(is_batch: bool, priority: int, arrival: float) -> tuple[int, int, float]:
    """Sort key of a queued request: smaller runs first."""
    return (1 if is_batch else 0, priority, arrival)


@dataclass(frozen=True)
class BatchGate:
    """conductor.batch_max_in_flight, batch_slo_margin and batch_backoff_s."""

    max_in_flight: int
    margin: float
    backoff_s: float


def batch_admission(probe: Placement | Rejection, num_in_flight: int, last_interactive_rejection: float | None,
                    gate: BatchGate, policy: PolicyConfig, now: float) -> str:
    """Why the next batch line may not start now ("" when it may)."""
    if num_in_flight >= gate.max_in_flight:
        return f"{num_in_flight} batch lines in flight (conductor.batch_max_in_flight)"
    if last_interactive_rejection is not None and now - last_interactive_rejection < gate.backoff_s:
        return "an interactive request was rejected recently: batch work yields"
    if isinstance(probe, Rejection):
        return f"no placement now: {probe.reason}"
    if probe.predicted_ttft_s > gate.margin * policy.ttft_slo_s:
        return f"predicted TTFT {probe.predicted_ttft_s:.3f} s over {gate.margin:g} x the SLO"
    if probe.predicted_tbt_s > gate.margin * policy.tbt_slo_s:
        return f"predicted TBT {probe.predicted_tbt_s:.3f} s over {gate.margin:g} x the SLO"
    return ""
