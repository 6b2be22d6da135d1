"""What the sampling controls do to one row of logits before a token is chosen (OpenAI's and vLLM's definitions).

1. `TokenHistory(token_ids, num_prompt_tokens)` is what a row's controls read: the request's prompt followed by
   every token it generated so far, wherever they were sampled (a migrated request's earlier output included).
2. `adjust_logits(logits, params, history, stop_token_ids, grammar_mask)` applies, in vLLM's order:
   - `logit_bias`: each listed token's bias is added to its logit;
   - `min_tokens`: while fewer output tokens than that exist, the stop tokens (`stop_token_ids`, and EOS unless
     `ignore_eos`) get -inf;
   - `repetition_penalty` r (Hugging Face's, vLLM's): a token of the prompt or the output with logit x gets x / r
     when x > 0, else x * r;
   - `frequency_penalty` f and `presence_penalty` p (OpenAI's): a token generated c times gets
     x - c * f - (p if c > 0 else 0); prompt tokens do not count;
   - `grammar_mask` (model/grammar.py: 0 for the tokens a grammar allows, -inf for the others) is added. Where the
     controls left no allowed token finite (min_tokens holding back the EOS a finished grammar needs), the grammar
     wins over them.
   Greedy requests take the argmax of the adjusted row; the others draw from it (sampler.py).
3. `keep_min_p(scores, min_p)` runs after temperature: it removes every token whose probability is below `min_p`
   times the most likely token's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mooncaked.model.sampling_params import SamplingParams


@dataclass(frozen=True)
class TokenHistory:
    """A request's tokens up to the row being sampled: the prompt, then its output so far."""

    token_ids: Sequence[int]
    num_prompt_tokens: int

    def __post_init__(self) -> None:
        assert 0 <= self.num_prompt_tokens <= len(self.token_ids), (self.num_prompt_tokens, len(self.token_ids))

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


def adjust_logits(logits: torch.Tensor, params: SamplingParams, history: TokenHistory | None,
                  stop_token_ids: Sequence[int], grammar_mask: torch.Tensor | None = None) -> torch.Tensor:
    """logits [vocab] -> a new fp32 row with the request's controls applied; `history` is needed when
    `params.needs_history`; `grammar_mask` (fp32 [vocab], 0 or -inf) is a grammar's."""
    scores = _apply_controls(logits.float().clone(), params, history, stop_token_ids)
    if grammar_mask is None:
        return scores
    mask = grammar_mask.to(scores.device)
    constrained = scores.add_(mask)
    if not params.is_adjusted or bool(constrained.max() > float("-inf")):
        return constrained
    return logits.float() + mask


def _apply_controls(scores: torch.Tensor, params: SamplingParams, history: TokenHistory | None,
                    stop_token_ids: Sequence[int]) -> torch.Tensor:
    device = scores.device
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=device)
        bias = torch.tensor([b for _, b in params.logit_bias], dtype=scores.dtype, device=device)
        scores.index_add_(0, ids, bias)
    if not params.needs_history:
        return scores
    if history is None:
        raise ValueError("penalties and min_tokens need the request's token history")
    tokens = torch.tensor(list(history.token_ids), dtype=torch.long, device=device)
    output = tokens[history.num_prompt_tokens:]
    if history.num_output_tokens < params.min_tokens and stop_token_ids:
        scores[torch.tensor(list(stop_token_ids), dtype=torch.long, device=device)] = float("-inf")
    if params.repetition_penalty != 1.0 and tokens.numel():
        seen = torch.zeros_like(scores, dtype=torch.bool)
        seen[tokens] = True
        penalized = torch.where(scores > 0, scores / params.repetition_penalty, scores * params.repetition_penalty)
        scores = torch.where(seen, penalized, scores)
    if (params.frequency_penalty or params.presence_penalty) and output.numel():
        counts = torch.bincount(output, minlength=scores.shape[0]).to(scores.dtype)
        scores -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(scores.dtype)
    return scores


def keep_min_p(scores: torch.Tensor, min_p: float) -> torch.Tensor:
    """scores [vocab] (temperature applied) -> the same with tokens below min_p x the top probability at -inf."""
    probs = torch.softmax(scores, dim=-1)
    return scores.masked_fill(probs < min_p * probs.max(), float("-inf"))
