"""Output-length predictions in the simulator, for prediction-based early rejection with imperfect predictions.

1. `run.output_length_predictor` picks the mode: `uniform` (the paper: every request decodes for the policy's
   t_d; nothing is predicted per request), `oracle` (the trace's true length times a log-normal factor of sigma
   `run.output_length_noise`: a predictor of known error), or `learned` (the daemon's OutputLengthPredictor,
   learning online from finished requests, with `run.max_tokens` as every request's max_tokens).
2. `predict(index, num_prompt_tokens, true_length)` at placement; `observe(...)` when a request finishes.
3. The engine turns predicted tokens into seconds with the decode instance's predicted step time.
"""

from __future__ import annotations

import random

from mooncaked.sched.output_length import OutputLengthPredictor

MODES = ("uniform", "oracle", "learned")


class OutputForecast:
    """Owns the learned predictor (mode `learned`) and the noise generator (mode `oracle`)."""

    def __init__(self, mode: str, *, noise: float, max_tokens: int, quantile: float, seed: int) -> None:
        if mode not in MODES:
            raise ValueError(f"output_length_predictor must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self.noise = noise
        self.max_tokens = max_tokens
        self.learned = OutputLengthPredictor(quantile=quantile)
        self.rng = random.Random(seed)

    @property
    def is_enabled(self) -> bool:
        return self.mode != "uniform"

    def predict(self, num_prompt_tokens: int, true_length: int) -> int:
        """Predicted output tokens of a request (0 under `uniform`)."""
        if self.mode == "oracle":
            factor = self.rng.lognormvariate(0.0, self.noise) if self.noise > 0 else 1.0
            return max(1, round(true_length * factor))
        if self.mode == "learned":
            return self.learned.predict(api_key="", max_tokens=self.max_tokens, num_prompt_tokens=num_prompt_tokens)
        return 0

    def observe(self, num_prompt_tokens: int, output_length: int) -> None:
        if self.mode == "learned":
            self.learned.observe(api_key="", max_tokens=self.max_tokens, num_prompt_tokens=num_prompt_tokens,
                                 num_output_tokens=min(output_length, self.max_tokens))
