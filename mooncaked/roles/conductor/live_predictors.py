"""The conductor's scheduling predictors, refitted from what the cluster measures (paper section 4.1).

1. They start from defaults: the model's shape over an assumed device, or a fit of `scheduler.prefill_profile`.
2. Prefill samples (prompt tokens, reused tokens, forward seconds) come from PREFILL replies' `compute_s`;
   decode samples (batch size, context tokens, step seconds) from decode instances' LOAD replies.
3. Every `min_samples` new samples of a kind refit that predictor over the newest `max_samples`; a fit the
   samples do not determine keeps the previous predictor.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from mooncaked.sched.predictors import DecodeStepPredictor, Predictors, PrefillTimePredictor


class LivePredictors:
    """Owns the scheduler's current predictors and the measured samples they are refitted from."""

    def __init__(self, defaults: Predictors, *, min_samples: int = 8, max_samples: int = 256) -> None:
        self.current = defaults
        self.min_samples = min_samples
        self._prefill: deque[tuple[int, int, float]] = deque(maxlen=max_samples)
        self._decode: deque[tuple[int, int, float]] = deque(maxlen=max_samples)
        self.num_refits = 0

    def add_prefill(self, num_tokens: int, num_prefix_tokens: int, seconds: float) -> None:
        self._prefill.append((num_tokens, num_prefix_tokens, seconds))
        if len(self._prefill) >= self.min_samples and len(self._prefill) % self.min_samples == 0:
            try:
                prefill = PrefillTimePredictor.fit(list(self._prefill))
            except ValueError:
                return
            self._replace(dataclasses.replace(self.current, prefill=prefill))

    def add_decode(self, batch_size: int, num_context_tokens: int, seconds: float) -> None:
        sample = (batch_size, num_context_tokens, seconds)
        if self._decode and self._decode[-1] == sample:
            return  # an idle poll repeats the last step's numbers
        self._decode.append(sample)
        if len(self._decode) >= self.min_samples and len(self._decode) % self.min_samples == 0:
            try:
                decode = DecodeStepPredictor.fit(list(self._decode))
            except ValueError:
                return
            self._replace(dataclasses.replace(self.current, decode=decode))

    def num_samples(self) -> dict[str, int]:
        return {"prefill": len(self._prefill), "decode": len(self._decode)}

    def _replace(self, predictors: Predictors) -> None:
        self.current = predictors
        self.num_refits += 1
