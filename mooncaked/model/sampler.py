"""Sampling parameters and next-token sampling from logits.

1. A request's `SamplingParams` is validated once at construction; an invalid value raises ValueError naming
   the parameter (the API layer turns that into a 400 with the field).
2. `make_generator(params)` gives a seeded torch.Generator per request (None: the sampler's shared one).
3. `Sampler.sample(logits, params, generators)` picks one token per row: greedy rows in one argmax, others
   through temperature, top-k and top-p, then a draw from that request's generator; optional logprobs come
   from the unmodified distribution.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    seed: int | None = None
    stop: Sequence[str] = ()  # stop strings, matched across token boundaries; stored as a tuple
    stop_token_ids: Sequence[int] = ()  # stored as a tuple
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the chosen token's; n: plus the n most likely
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # OpenAI accepts one string or a list
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be a number in [0, 100], got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1 disable it), got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {list(self.stop)!r}")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {list(self.stop_token_ids)!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


@dataclass(frozen=True)
class SampleOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A per-request generator when the request gives a seed (same seed, same tokens)."""
    if params.seed is None or params.is_greedy:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


class Sampler:
    """Stateless apart from the shared generator used by unseeded requests (owned by the sampler)."""

    def __init__(self, seed: int | None = None, device: torch.device | str = "cpu") -> None:
        self._shared = torch.Generator(device=device)
        if seed is None:
            self._shared.seed()
        else:
            self._shared.manual_seed(seed)

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               generators: Sequence[torch.Generator | None] | None = None) -> SampleOutput:
        """logits fp32 [S, vocab] -> one token per row."""
        num_rows = logits.shape[0]
        if len(params) != num_rows:
            raise ValueError(f"got {len(params)} sampling params for {num_rows} logit rows")
        gens = list(generators) if generators is not None else [None] * num_rows
        if all(p.is_greedy for p in params):
            token_ids = logits.argmax(dim=-1).tolist()
        else:
            token_ids = [self._sample_row(logits[i], params[i], gens[i]) for i in range(num_rows)]
        return SampleOutput(token_ids=token_ids, logprobs=_logprobs(logits, token_ids, params))

    def _sample_row(self, logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
        """logits [vocab] -> token id."""
        if params.is_greedy:
            return int(logits.argmax().item())
        scores = logits / params.temperature
        if params.top_k > 0 and params.top_k < scores.shape[0]:
            kth = torch.topk(scores, params.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if params.top_p < 1.0:
            probs = _top_p_filter(probs, params.top_p)
        return int(torch.multinomial(probs, 1, generator=gen or self._shared).item())


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest most-likely set whose mass reaches top_p (always at least one token)."""
    sorted_probs, order = probs.sort(descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter_(0, order, sorted_probs)


def _logprobs(logits: torch.Tensor, token_ids: list[int],
              params: Sequence[SamplingParams]) -> list[TokenLogprobs | None]:
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(params)
    if not rows:
        return result
    log_probs = torch.log_softmax(logits[rows].float(), dim=-1)
    for j, i in enumerate(rows):
        n = params[i].logprobs or 0
        top = torch.topk(log_probs[j], n) if n else None
        top_pairs = tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else ()
        result[i] = TokenLogprobs(token_id=token_ids[i], logprob=float(log_probs[j, token_ids[i]]), top=top_pairs)
    return result
