"""Output-length prediction (the paper's future work): how many tokens a request will still generate.

1. `observe` records a finished request's output length, as a fraction of its `max_tokens`, under every level of
   its key: (API key, max_tokens bucket, prompt length bucket), (API key, max_tokens bucket), (max_tokens bucket,
   prompt length bucket), (max_tokens bucket) and the whole cluster. Buckets are powers of two.
2. `predict` answers from the most specific level holding at least `min_samples` lengths longer than what the
   request already generated: the `quantile` of those lengths (a high quantile makes early rejection
   conservative), at least one more token and at most `max_tokens`. With no such level it answers `max_tokens`
   (the most a client allowed: conservative until the predictor has learned).
3. Each level keeps the newest `window` lengths; at most `max_keys` keys are kept (the least recently used go).

Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque

Key = tuple[object, ...]


def _bucket(value: int) -> int:
    """The power of two at or above `value` (1 for anything below 1)."""
    return 1 << max(int(value) - 1, 0).bit_length()


class OutputLengthPredictor:
    """Owns the recent output lengths per key (owned by the conductor)."""

    def __init__(self, *, quantile: float = 0.9, window: int = 256, min_samples: int = 8,
                 max_keys: int = 4096) -> None:
        if not 0.0 < quantile <= 1.0:
            raise ValueError(f"quantile must be in (0, 1], got {quantile}")
        if window < 1 or min_samples < 1 or max_keys < 5:
            raise ValueError("window and min_samples must be >= 1 and max_keys >= 5")
        self.quantile = quantile
        self.window = window
        self.min_samples = min_samples
        self.max_keys = max_keys
        self._fractions: OrderedDict[Key, deque[float]] = OrderedDict()
        self.num_observed = 0

    @staticmethod
    def levels(api_key: str, max_tokens: int, num_prompt_tokens: int) -> list[Key]:
        """The keys of a request, most specific first."""
        mt, pb = _bucket(max_tokens), _bucket(num_prompt_tokens)
        return [("key", api_key, mt, pb), ("key", api_key, mt), ("len", mt, pb), ("len", mt), ("all",)]

    def observe(self, *, api_key: str, max_tokens: int, num_prompt_tokens: int, num_output_tokens: int) -> None:
        if max_tokens < 1 or num_output_tokens < 0:
            return
        fraction = min(num_output_tokens / max_tokens, 1.0)
        for key in self.levels(api_key, max_tokens, num_prompt_tokens):
            window = self._fractions.get(key)
            if window is None:
                window = self._fractions[key] = deque(maxlen=self.window)
                if len(self._fractions) > self.max_keys:
                    self._fractions.popitem(last=False)
            self._fractions.move_to_end(key)
            window.append(fraction)
        self.num_observed += 1

    def predict(self, *, api_key: str, max_tokens: int, num_prompt_tokens: int, num_generated: int = 0) -> int:
        """Predicted total output tokens (generated so far included), in [num_generated + 1, max_tokens]."""
        max_tokens = max(max_tokens, 1)
        floor = min(num_generated + 1, max_tokens)
        already = num_generated / max_tokens
        for key in self.levels(api_key, max_tokens, num_prompt_tokens):
            window = self._fractions.get(key)
            if window is None:
                continue
            longer = sorted(f for f in window if f > already)
            if len(longer) >= self.min_samples:
                rank = min(math.ceil(self.quantile * len(longer)) - 1, len(longer) - 1)
                return max(floor, min(max_tokens, math.ceil(longer[max(rank, 0)] * max_tokens)))
        return max_tokens
