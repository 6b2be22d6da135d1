"""The sampling controls as their definitions read, in plain Python floats: what the sampler must equal.

- logit_bias (OpenAI): the bias is added to the token's logit.
- min_tokens (vLLM): before that many output tokens, the stop tokens (stop_token_ids, EOS unless ignore_eos)
  cannot be chosen.
- repetition_penalty r (Hugging Face, vLLM): for every token of the prompt or the output, x -> x / r if x > 0
  else x * r.
- frequency_penalty f, presence_penalty p (OpenAI): mu[j] -> mu[j] - c[j] * f - (c[j] > 0) * p, c[j] the times
  token j was generated.
- temperature t, then min_p m (keep p_j >= m * max p), top_k k (keep the k largest, ties kept), top_p q (the
  smallest most likely set whose mass reaches q), renormalized.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

NEG_INF = float("-inf")


def reference_adjust(logits: Sequence[float], *, prompt: Sequence[int], output: Sequence[int],
                     logit_bias: Sequence[tuple[int, float]] = (), min_tokens: int = 0,
                     stop_ids: Sequence[int] = (), repetition_penalty: float = 1.0,
                     frequency_penalty: float = 0.0, presence_penalty: float = 0.0) -> list[float]:
    scores = [float(x) for x in logits]
    for token, bias in logit_bias:
        scores[token] += bias
    if len(output) < min_tokens:
        for token in stop_ids:
            scores[token] = NEG_INF
    if repetition_penalty != 1.0:
        for token in set(prompt) | set(output):
            x = scores[token]
            scores[token] = x / repetition_penalty if x > 0 else x * repetition_penalty
    for token, count in Counter(output).items():
        scores[token] -= count * frequency_penalty + presence_penalty
    return scores


def reference_probs(scores: Sequence[float], *, temperature: float, min_p: float = 0.0, top_k: int = 0,
                    top_p: float = 1.0) -> list[float]:
    """The distribution a non-greedy request draws from, given its adjusted scores."""
    scaled = [x / temperature for x in scores]
    probs = _softmax(scaled)
    if min_p > 0.0:
        threshold = min_p * max(probs)
        scaled = [x if p >= threshold else NEG_INF for x, p in zip(scaled, probs)]
    if 0 < top_k < len(scaled):
        kth = sorted(scaled, reverse=True)[top_k - 1]
        scaled = [x if x >= kth else NEG_INF for x in scaled]
    probs = _softmax(scaled)
    if top_p < 1.0:
        order = sorted(range(len(probs)), key=lambda j: -probs[j])
        kept, mass = set(), 0.0
        for j in order:
            if mass >= top_p:
                break
            kept.add(j)
            mass += probs[j]
        probs = [p if j in kept else 0.0 for j, p in enumerate(probs)]
    total = sum(probs)
    return [p / total for p in probs]


def _softmax(scores: Sequence[float]) -> list[float]:
    top = max(scores)
    exps = [math.exp(x - top) if x != NEG_INF else 0.0 for x in scores]
    total = sum(exps)
    return [e / total for e in exps]
