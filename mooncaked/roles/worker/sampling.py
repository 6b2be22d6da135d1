"""From wire sampling specs to the model's sampler and back: the worker side of token selection.

1. `to_params(spec, vocab_size)` builds the sampler's SamplingParams (its validation names the bad parameter;
   a logit bias outside the vocabulary is refused too).
2. `sample_rows(worker, logits, params, generators, histories)` samples one token per row on the compute thread
   and returns wire `TokenSample`s with logprobs when asked. A row whose controls read the request's history
   (penalties, min_tokens) gets it from `history_of`: a leg's token ids are the prompt followed by the
   `num_sampled` tokens streamed before the leg, so every instance, after any migration, sees the whole output.
   A row with a grammar (grammar.py) is drawn from the tokens it allows, and the grammar advances by the token.
3. A seeded request's k-th output token is sampled from a generator seeded by (seed, k) (`generator_at`,
   `reseed`), so sampling does not depend on which instance, or how many, produced the tokens before it:
   a request migrated mid-stream samples on exactly as it would have.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from mooncaked.model.grammar import GrammarState
from mooncaked.model.logits_processing import TokenHistory
from mooncaked.model.sampler import make_generator
from mooncaked.model.sampling_params import MAX_LOGPROBS, SamplingParams
from mooncaked.roles.worker.grammar import Masks
from mooncaked.roles.worker.messages import SamplingSpec, TokenSample
from mooncaked.roles.worker.worker import Worker
from mooncaked.rpc import InvalidArgument

MAX_SEQUENCES = 64  # parallel sampling: sequences per request (the API's n and best_of are within it)


def to_params(spec: SamplingSpec, vocab_size: int) -> SamplingParams:
    try:
        params = SamplingParams(
            max_tokens=spec.max_tokens, temperature=spec.temperature, top_k=spec.top_k, top_p=spec.top_p,
            seed=spec.seed, stop_token_ids=tuple(spec.stop_token_ids), ignore_eos=spec.ignore_eos,
            logprobs=spec.num_logprobs, presence_penalty=spec.presence_penalty,
            frequency_penalty=spec.frequency_penalty, repetition_penalty=spec.repetition_penalty, min_p=spec.min_p,
            logit_bias=tuple((b.token_id, b.bias) for b in spec.logit_bias), min_tokens=spec.min_tokens)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
    if not 1 <= spec.num_sequences <= MAX_SEQUENCES:
        raise InvalidArgument(f"num_sequences must be in [1, {MAX_SEQUENCES}], got {spec.num_sequences}")
    if spec.num_prompt_logprobs is not None and not 0 <= spec.num_prompt_logprobs <= MAX_LOGPROBS:
        raise InvalidArgument(f"num_prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {spec.num_prompt_logprobs}")
    outside = [t for t, _ in params.logit_bias] + list(params.stop_token_ids)
    if any(t >= vocab_size for t in outside):
        raise InvalidArgument(f"logit_bias and stop_token_ids must name token ids in [0, {vocab_size})")
    return params


def history_of(token_ids: Sequence[int], params: SamplingParams, num_sampled: int) -> TokenHistory | None:
    """What the controls of a row after `token_ids` read: its last `num_sampled` tokens are output (None when
    the request's controls read no history)."""
    if not params.needs_history:
        return None
    if not 0 <= num_sampled <= len(token_ids):
        raise InvalidArgument(f"num_sampled {num_sampled} does not fit the leg's {len(token_ids)} tokens")
    return TokenHistory(token_ids, len(token_ids) - num_sampled)


def sequence_params(params: SamplingParams, sequence: int) -> SamplingParams:
    """Sequence `sequence`'s parameters in a parallel sampling: its own seed stream (sequence 0 keeps the request's
    seed, so n = 1 and choice 0 of a seeded n > 1 sample alike)."""
    if sequence == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=seed_for_token(params.seed, -1 - sequence))


def seed_for_token(seed: int, index: int) -> int:
    """The generator seed of a request's `index`-th output token (a splitmix64-style mix, in [0, 2**63))."""
    value = (seed + (index + 1) * 0x9E3779B97F4A7C15) % 2**64
    value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9 % 2**64
    value = (value ^ (value >> 27)) * 0x94D049BB133111EB % 2**64
    return (value ^ (value >> 31)) % 2**63


def reseed(generator: torch.Generator | None, params: SamplingParams, index: int) -> None:
    if generator is not None and params.seed is not None:
        generator.manual_seed(seed_for_token(params.seed, index))


def generator_at(params: SamplingParams, index: int) -> torch.Generator | None:
    """The generator for output token `index` of a request (None when unseeded or greedy)."""
    generator = make_generator(params)
    reseed(generator, params, index)
    return generator


def sample_rows(worker: Worker, logits: torch.Tensor, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None],
                histories: Sequence[TokenHistory | None] | None = None,
                grammars: Sequence[GrammarState | None] | None = None,
                masks: Masks | None = None) -> list[TokenSample]:
    """logits fp32 [S, vocab] -> S samples (compute thread). Rows with a grammar are drawn from its allowed tokens
    (`masks`: their masks already under way on the mask thread) and advance it by the token drawn."""
    assert worker.sampler is not None and worker.grammar is not None
    if grammars is not None and masks is None:
        masks = worker.grammar.masks(grammars)
    output = worker.sampler.sample(logits, params, generators, histories, None if masks is None else masks.result())
    for grammar, token_id in zip(grammars or (), output.token_ids):
        if grammar is not None:
            grammar.advance(token_id)
    samples = []
    for token_id, logprobs in zip(output.token_ids, output.logprobs):
        if logprobs is None:
            samples.append(TokenSample(token_id=token_id))
            continue
        samples.append(TokenSample(token_id=token_id, logprob=logprobs.logprob,
                                   top_token_ids=[t for t, _ in logprobs.top],
                                   top_logprobs=[lp for _, lp in logprobs.top]))
    return samples
