"""One instance's performance model: its prefill-time and decode-step predictors, fitted from its own samples.

1. The worker profiles itself before it reports ready (`add_profile_prefill` / `add_profile_decode`); profile
   samples are kept for good, because they span the lengths and batch sizes live traffic may not reach.
2. While serving it adds one sample per prefilled request (`add_prefill`: a batch's time split by
   `attribute_batch_time`, so samples are per-request costs) and one per decode step (`add_decode`).
3. Every `refit_every` new samples of a kind (and after the profile) that predictor is refitted by least squares
   of the relative error (TTFT and TBT errors matter relative to their size) over the profile plus the newest
   `max_live_samples` live samples: prefill in the paper's form (a constant, new tokens, and attention over
   the context: n^2 - p^2), decode as a constant plus per-sequence and per-context-token terms, every term but
   the constant non-negative. A fit the samples do not determine keeps the previous predictor.
4. Between refits a scale follows how the instance runs now against its fit: `observe_prefill_batch` (a batch's
   time over its prediction) and `observe_decode_interval` (the time from one step's start to the next, which
   includes inline prefills and anything else sharing the compute thread, over the step's prediction). The
   predictors used and reported (`prefill`, `decode`, `coefficients()`) are the fits times their scale. A refit
   carries the scale over so that the newest samples are predicted as before it: the new fit (which mixes the
   profile, taken idle, with live samples) changes how sizes compare, not how fast the instance runs now.

Pure: no clock, no I/O; the caller measures and passes seconds in.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from mooncaked.sched.predictors import DecodeStepPredictor, PrefillTimePredictor

# Eq. 1's constants (FLOPs per layer: a n^2 d for attention, b n d^2 for the projections and MLP).
ATTENTION_FLOPS_A = 4.0
PROJECTION_FLOPS_B = 22.0


def prefill_flops(num_tokens: int, num_prefix_tokens: int, hidden_size: int) -> float:
    """Eq. 1's FLOPs (per layer) of computing tokens p..n after a reused prefix of p: a d (n^2 - p^2) + b d^2 (n - p)."""
    n = float(num_tokens)
    p = float(min(max(num_prefix_tokens, 0), num_tokens))
    return ATTENTION_FLOPS_A * hidden_size * (n * n - p * p) + PROJECTION_FLOPS_B * hidden_size**2 * (n - p)


def attribute_batch_time(batch_s: float, prompts: Sequence[tuple[int, int]], hidden_size: int) -> list[float]:
    """A batched prefill's seconds split over its prompts `(num_tokens, num_prefix_tokens)` by compute share.

    The shares sum to `batch_s` exactly; a batch whose prompts have no new tokens splits evenly.
    """
    weights = [prefill_flops(n, p, hidden_size) for n, p in prompts]
    total = sum(weights)
    if total <= 0:
        return [batch_s / len(prompts)] * len(prompts) if prompts else []
    return [batch_s * w / total for w in weights]


SCALE_WEIGHT = 0.3  # weight of the newest ratio in a scale: a change of speed shows within a few batches or steps
SCALE_LIMITS = (0.25, 8.0)
CARRY_SAMPLES = 16  # the newest live samples a refit keeps predicting as before


def _factor(scale: RecentMean) -> float:
    if not scale.count:
        return 1.0
    return min(max(scale.value, SCALE_LIMITS[0]), SCALE_LIMITS[1])


class _Fit(Protocol):
    def predict(self, first: int, second: int, /) -> float: ...


def _mean_ratio(old: _Fit | None, new: _Fit, samples: Sequence[tuple[int, int, float]]) -> float:
    """How much longer the old fit predicted the newest samples than the new one (1 for a first fit or no
    samples)."""
    if old is None:
        return 1.0
    recent = list(samples)[-CARRY_SAMPLES:]
    old_total = sum(old.predict(a, b) for a, b, _ in recent)
    new_total = sum(new.predict(a, b) for a, b, _ in recent)
    return old_total / new_total if old_total > 0 and new_total > 0 else 1.0


def _carried(scale: RecentMean, fit_ratio: float) -> RecentMean:
    """A new fit's scale that keeps the recent samples' predictions: the old factor times old over new."""
    carried = RecentMean(SCALE_WEIGHT)
    if scale.count:
        carried.add(_factor(scale) * fit_ratio)
    return carried


def _is_time(seconds: float) -> bool:
    return math.isfinite(seconds) and seconds > 0


class RecentMean:
    """A running mean that weighs the newest value by at least `weight` (a plain mean until then)."""

    def __init__(self, weight: float = 0.2) -> None:
        self.weight = weight
        self.value = 0.0
        self.count = 0

    def add(self, value: float) -> None:
        if not math.isfinite(value):
            return
        self.count += 1
        self.value += max(self.weight, 1.0 / self.count) * (value - self.value)


@dataclass(frozen=True)
class ModelCoefficients:
    """What an instance reports: its fitted predictors' coefficients (empty until fitted)."""

    prefill: tuple[float, ...] = ()
    decode: tuple[float, ...] = ()


class PerformanceModel:
    """Owns one instance's samples and its current fitted predictors (owned by the worker)."""

    def __init__(self, *, refit_every: int = 8, max_live_samples: int = 256) -> None:
        if refit_every < 1 or max_live_samples < 1:
            raise ValueError("refit_every and max_live_samples must be >= 1")
        self.refit_every = refit_every
        self.prefill_fit: PrefillTimePredictor | None = None
        self.decode_fit: DecodeStepPredictor | None = None
        self.prefill_scale = RecentMean(SCALE_WEIGHT)
        self.decode_scale = RecentMean(SCALE_WEIGHT)
        self.num_refits = 0
        self._profile_prefill: list[tuple[int, int, float]] = []
        self._profile_decode: list[tuple[int, int, float]] = []
        self._live_prefill: deque[tuple[int, int, float]] = deque(maxlen=max_live_samples)
        self._live_decode: deque[tuple[int, int, float]] = deque(maxlen=max_live_samples)
        self._num_new_prefill = 0
        self._num_new_decode = 0

    @property
    def prefill(self) -> PrefillTimePredictor | None:
        """The fitted prefill model times its current scale (None before any fit)."""
        if self.prefill_fit is None:
            return None
        factor = _factor(self.prefill_scale)
        return PrefillTimePredictor(tuple(c * factor for c in self.prefill_fit.coefficients))

    @property
    def decode(self) -> DecodeStepPredictor | None:
        """The fitted step model times its current scale: the predicted time between tokens."""
        if self.decode_fit is None:
            return None
        factor = _factor(self.decode_scale)
        c0, c1, c2 = self.decode_fit.coefficients
        return DecodeStepPredictor((c0 * factor, c1 * factor, c2 * factor))

    def observe_prefill_batch(self, predicted_s: float, actual_s: float) -> None:
        """A batch took `actual_s` where the fit (unscaled) predicted `predicted_s`."""
        if predicted_s > 0 and _is_time(actual_s):
            self.prefill_scale.add(actual_s / predicted_s)

    def observe_decode_interval(self, batch_size: int, num_context_tokens: int, interval_s: float) -> None:
        """Two steps over this batch started `interval_s` apart (the step, and what waited in between)."""
        if self.decode_fit is not None and _is_time(interval_s):
            predicted_s = self.decode_fit.predict(batch_size, num_context_tokens)
            if predicted_s > 0:
                self.decode_scale.add(interval_s / predicted_s)

    # ---- samples ------------------------------------------------------------------------------------------
    def add_profile_prefill(self, num_tokens: int, num_prefix_tokens: int, seconds: float) -> None:
        if _is_time(seconds):
            self._profile_prefill.append((num_tokens, num_prefix_tokens, seconds))

    def add_profile_decode(self, batch_size: int, num_context_tokens: int, seconds: float) -> None:
        if _is_time(seconds):
            self._profile_decode.append((batch_size, num_context_tokens, seconds))

    def add_prefill(self, num_tokens: int, num_prefix_tokens: int, seconds: float) -> None:
        if not _is_time(seconds):
            return
        self._live_prefill.append((num_tokens, num_prefix_tokens, seconds))
        self._num_new_prefill += 1
        if self._num_new_prefill >= self.refit_every:
            self.refit_prefill()

    def add_decode(self, batch_size: int, num_context_tokens: int, seconds: float) -> None:
        if not _is_time(seconds):
            return
        self._live_decode.append((batch_size, num_context_tokens, seconds))
        self._num_new_decode += 1
        if self._num_new_decode >= self.refit_every:
            self.refit_decode()

    def num_samples(self) -> dict[str, int]:
        return {"prefill_profile": len(self._profile_prefill), "prefill_live": len(self._live_prefill),
                "decode_profile": len(self._profile_decode), "decode_live": len(self._live_decode)}

    # ---- fits ---------------------------------------------------------------------------------------------
    def refit(self) -> None:
        self.refit_prefill()
        self.refit_decode()

    def refit_prefill(self) -> None:
        self._num_new_prefill = 0
        try:
            fit = PrefillTimePredictor.fit_paper_form([*self._profile_prefill, *self._live_prefill])
        except ValueError:
            return
        self.prefill_scale = _carried(self.prefill_scale, _mean_ratio(self.prefill_fit, fit, self._live_prefill))
        self.prefill_fit = fit
        self.num_refits += 1

    def refit_decode(self) -> None:
        self._num_new_decode = 0
        try:
            fit = DecodeStepPredictor.fit([*self._profile_decode, *self._live_decode], relative=True)
        except ValueError:
            return
        self.decode_scale = _carried(self.decode_scale, _mean_ratio(self.decode_fit, fit, self._live_decode))
        self.decode_fit = fit
        self.num_refits += 1

    def coefficients(self) -> ModelCoefficients:
        prefill, decode = self.prefill, self.decode
        return ModelCoefficients(prefill.coefficients if prefill is not None else (),
                                 decode.coefficients if decode is not None else ())
