"""A completion's `best_of`: more sequences sampled than returned; the `n` with the highest log-probability per
token come back (OpenAI's rule), as choices 0..n-1 in that order (docs/api.md#parallel-sampling).

`with_best_of(chunks, n)` holds every chunk until all sequences ended (a best_of answer is never streamed: the API
refuses that), adds up each sequence's token logprobs (sampling_spec asks the instances for them), and yields the
chosen sequences' chunks renumbered. Usage counts the tokens of the returned choices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from mooncaked.api.backend import GenerationChunk
from mooncaked.runtime.aio import aclose


async def with_best_of(chunks: AsyncIterator[GenerationChunk], n: int) -> AsyncIterator[GenerationChunk]:
    held: dict[int, list[GenerationChunk]] = {}
    try:
        async for chunk in chunks:
            held.setdefault(chunk.index, []).append(chunk)
    finally:
        await aclose(chunks)
    best = sorted(held, key=lambda sequence: -_mean_logprob(held[sequence]))[:n]
    for rank, sequence in enumerate(best):
        for chunk in held[sequence]:
            yield dataclasses.replace(chunk, index=rank)


def _mean_logprob(chunks: list[GenerationChunk]) -> float:
    logprobs = [item.logprob for chunk in chunks for item in chunk.logprobs or ()]
    return sum(logprobs) / len(logprobs) if logprobs else float("-inf")
