"""What a prefill instance measures of itself and reports in LOAD: samples for its model, held work, overhead.

1. `batch_started(prompts, now)`: the running batch's predicted seconds (its model, per prompt).
2. `batch_finished(prompts, elapsed_s, is_sample)`: the batch's time against the fit's prediction (the model's
   scale), and split over its prompts by compute share (`attribute_batch_time`), one honest per-request sample
   each. A batch that loaded a prefix from another host's store is no sample (`is_sample` False): its forward
   waited for the link layer by layer, and the scheduler counts the link apart (T_transfer at the measured rate);
   learnt as compute, a slow link would make recomputing look slow too.
3. `replied(total_s, wait_s, compute_s)`: a request's seconds on this instance outside queueing and compute
   (KV planning, fetches, write confirmation), averaged into `overhead_s`.
4. `pending_work_s(queued, now)`: what the instance still holds, in predicted seconds: the rest of the running
   batch plus every queued prompt (a prefill group's first stage: predicted through the group's pipeline).
   Conductors add their own requests this does not count yet.
5. A running batch past its predicted time shows the instance runs slower than its model right now (another
   process took the cores, a cold cache) long before the batch ends and the scale learns it: `slowdown(now)`
   (elapsed over predicted, at least 1) multiplies the queue's predictions and the coefficients LOAD reports.
"""

from __future__ import annotations

from collections.abc import Sequence

from mooncaked.sched.perf_model import ModelCoefficients, PerformanceModel, RecentMean, attribute_batch_time
from mooncaked.sched.pipeline import PipelinePredictor
from mooncaked.sched.types import PipelineSpec


class PrefillLoad:
    """Owns the running batch's prediction and the overhead average (owned by the PrefillRole)."""

    def __init__(self, perf: PerformanceModel, hidden_size: int) -> None:
        self.perf = perf
        self.hidden_size = hidden_size
        self.pipeline: PipelineSpec | None = None  # a prefill group's first stage: the group's (group/monitor.py)
        self.overhead = RecentMean()
        self.mean_batch_s = 0.0
        self._batch_predicted_s = 0.0
        self._batch_fit_s = 0.0
        self._batch_started = 0.0

    def predict(self, num_tokens: int, num_prefix_tokens: int) -> float:
        """This instance's predicted compute seconds for one prompt (0 until its model is fitted); a group's first
        stage predicts the whole pipeline."""
        if self.pipeline is not None:
            return PipelinePredictor(self.pipeline).predict(num_tokens, num_prefix_tokens)
        model = self.perf.prefill
        return model.predict(num_tokens, num_prefix_tokens) if model is not None else 0.0

    def batch_started(self, prompts: Sequence[tuple[int, int]], now: float) -> None:
        self._batch_predicted_s = sum(self.predict(n, p) for n, p in prompts)
        fit = self.perf.prefill_fit
        self._batch_fit_s = sum(fit.predict(n, p) for n, p in prompts) if fit is not None else 0.0
        self._batch_started = now

    def batch_finished(self, prompts: Sequence[tuple[int, int]], elapsed_s: float, is_sample: bool = True) -> None:
        self._batch_predicted_s = 0.0
        self.mean_batch_s = elapsed_s if not self.mean_batch_s else 0.8 * self.mean_batch_s + 0.2 * elapsed_s
        if not is_sample:
            return
        self.perf.observe_prefill_batch(self._batch_fit_s, elapsed_s)
        for (n, p), seconds in zip(prompts, attribute_batch_time(elapsed_s, prompts, self.hidden_size)):
            self.perf.add_prefill(n, p, seconds)

    def replied(self, total_s: float, wait_s: float, compute_s: float) -> None:
        self.overhead.add(max(total_s - wait_s - compute_s, 0.0))

    def slowdown(self, now: float) -> float:
        """How many times its predicted time the running batch has taken so far, at least 1 (1 when idle)."""
        if self._batch_predicted_s <= 0:
            return 1.0
        return max((now - self._batch_started) / self._batch_predicted_s, 1.0)

    def pending_work_s(self, queued: Sequence[tuple[int, int]], now: float) -> float:
        running_s = max(self._batch_predicted_s - (now - self._batch_started), 0.0)
        return running_s + self.slowdown(now) * sum(self.predict(n, p) for n, p in queued)

    def coefficients(self, now: float) -> ModelCoefficients:
        """The model's coefficients, the prefill ones times the running batch's slowdown."""
        coefficients, slowdown = self.perf.coefficients(), self.slowdown(now)
        return ModelCoefficients(tuple(c * slowdown for c in coefficients.prefill), coefficients.decode)

    def pipeline_now(self, now: float) -> PipelineSpec | None:
        """A group's pipeline, every stage's coefficients times the running prompt's slowdown."""
        spec, slowdown = self.pipeline, self.slowdown(now)
        if spec is None:
            return None
        stages = tuple(tuple(c * slowdown for c in stage) for stage in spec.stage_coefficients)
        return PipelineSpec(stages, spec.chunk_tokens, spec.handoff_s)
