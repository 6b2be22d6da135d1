"""From wire sampling specs to the model's sampler and back: the worker side of token selection.

1. `to_params(spec)` builds the sampler's SamplingParams (its validation names the bad parameter).
2. `sample_rows(worker, logits, params, generators)` samples one token per row on the compute thread and
   returns wire `TokenSample`s with logprobs when asked.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mooncaked.model.sampler import SamplingParams
from mooncaked.roles.worker.messages import SamplingSpec, TokenSample
from mooncaked.roles.worker.worker import Worker
from mooncaked.rpc import InvalidArgument


def to_params(spec: SamplingSpec) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=spec.max_tokens, temperature=spec.temperature, top_k=spec.top_k,
                              top_p=spec.top_p, seed=spec.seed, stop_token_ids=tuple(spec.stop_token_ids),
                              ignore_eos=spec.ignore_eos, logprobs=spec.num_logprobs)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def sample_rows(worker: Worker, logits: torch.Tensor, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None]) -> list[TokenSample]:
    """logits fp32 [S, vocab] -> S samples (compute thread)."""
    assert worker.sampler is not None
    output = worker.sampler.sample(logits, params, generators)
    samples = []
    for token_id, logprobs in zip(output.token_ids, output.logprobs):
        if logprobs is None:
            samples.append(TokenSample(token_id=token_id))
            continue
        samples.append(TokenSample(token_id=token_id, logprob=logprobs.logprob,
                                   top_token_ids=[t for t, _ in logprobs.top],
                                   top_logprobs=[lp for _, lp in logprobs.top]))
    return samples
