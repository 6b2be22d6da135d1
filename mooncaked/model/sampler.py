"""Sampling parameters and next-token sampling from logits.

1. A request's `SamplingParams` (sampling_params.py) is validated once at construction.
2. `make_generator(params)` gives a seeded torch.Generator per request (None: the sampler's shared one).
3. `Sampler.sample(logits, params, generators, histories)` picks one token per row: first the row's logit bias,
   min_tokens and penalties (logits_processing.py, over the row's `TokenHistory`); then greedy rows take the
   argmax, the others go through temperature, min-p, top-k and top-p (`candidate_probs`) and a draw from that
   request's generator. Optional logprobs come from the unmodified distribution (vLLM's default).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mooncaked.model.logits_processing import TokenHistory, adjust_logits, keep_min_p
from mooncaked.model.sampling_params import SamplingParams

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

    def __init__(self, seed: int | None = None, device: torch.device | str = "cpu",
                 eos_token_ids: Sequence[int] = ()) -> None:
        self.eos_token_ids = tuple(eos_token_ids)  # the model's: held back until min_tokens unless ignore_eos
        self._shared = torch.Generator(device=device)
        if seed is None:
            self._shared.seed()
        else:
            self._shared.manual_seed(seed)

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               generators: Sequence[torch.Generator | None] | None = None,
               histories: Sequence[TokenHistory | None] | None = None,
               masks: Sequence[torch.Tensor | None] | None = None) -> SampleOutput:
        """logits fp32 [S, vocab] -> one token per row; `histories[i]` is needed when `params[i].needs_history`;
        `masks[i]` (a grammar's logit mask: fp32 [vocab], 0 or -inf) restricts row i to its allowed tokens."""
        num_rows = logits.shape[0]
        if len(params) != num_rows:
            raise ValueError(f"got {len(params)} sampling params for {num_rows} logit rows")
        gens = list(generators) if generators is not None else [None] * num_rows
        scores = self.adjusted(logits, params, histories, masks)
        if all(p.is_greedy for p in params):
            token_ids = scores.argmax(dim=-1).tolist()
        else:
            token_ids = [self._sample_row(scores[i], params[i], gens[i]) for i in range(num_rows)]
        return SampleOutput(token_ids=token_ids, logprobs=_logprobs(logits, token_ids, params))

    def adjusted(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 histories: Sequence[TokenHistory | None] | None = None,
                 masks: Sequence[torch.Tensor | None] | None = None) -> torch.Tensor:
        """logits [S, vocab] with each row's logit bias, min_tokens, penalties and grammar mask applied (the input
        itself when no row has any)."""
        row_masks = list(masks) if masks is not None else [None] * len(params)
        rows = [i for i, p in enumerate(params) if p.is_adjusted or row_masks[i] is not None]
        if not rows:
            return logits
        scores = logits.float().clone()
        for i in rows:
            history = histories[i] if histories is not None else None
            scores[i] = adjust_logits(logits[i], params[i], history, self.stop_token_ids(params[i]), row_masks[i])
        return scores

    def stop_token_ids(self, params: SamplingParams) -> tuple[int, ...]:
        """The tokens min_tokens holds back: the request's stop tokens, and EOS unless it ignores EOS."""
        return tuple(params.stop_token_ids) + (() if params.ignore_eos else self.eos_token_ids)

    def _sample_row(self, scores: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
        """scores [vocab] -> token id."""
        if params.is_greedy:
            return int(scores.argmax().item())
        probs = candidate_probs(scores, params)
        return int(torch.multinomial(probs, 1, generator=gen or self._shared).item())


def candidate_probs(scores: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """scores [vocab] (already adjusted) -> the distribution a non-greedy request draws from: temperature, then
    min-p, top-k (ties at the k-th value kept) and top-p."""
    scores = scores / params.temperature
    if params.min_p > 0.0:
        scores = keep_min_p(scores, params.min_p)
    if params.top_k > 0 and params.top_k < scores.shape[0]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        probs = _top_p_filter(probs, params.top_p)
    return probs


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
