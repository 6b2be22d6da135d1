"""A completion with `echo`: its answer starts with the prompt (docs/api.md#echo-and-prompt-logprobs).

`with_echo(chunks, echo_text, is_prompt_only, num_choices)` puts the prompt's text on each choice's first chunk (the
prompt logprobs are already on the request's first, from the prefill: request_run.py). With `max_tokens: 0` (what
evaluation harnesses send to score a prompt) the one token the prefill samples anyway is left out: no text, no token
counted, finish "length".
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from mooncaked.api.backend import GenerationChunk
from mooncaked.runtime.aio import aclose


async def with_echo(chunks: AsyncIterator[GenerationChunk], echo_text: str, is_prompt_only: bool,
                    num_choices: int) -> AsyncIterator[GenerationChunk]:
    echoed: set[int] = set()
    try:
        async for chunk in chunks:
            if chunk.index in echoed:
                if is_prompt_only:
                    continue
                yield chunk
                continue
            echoed.add(chunk.index)
            if is_prompt_only:
                chunk = dataclasses.replace(chunk, token_ids=(), text="", finish_reason="length",
                                            logprobs=None if chunk.logprobs is None else ())
            yield dataclasses.replace(chunk, echo_text=echo_text)
            if is_prompt_only and len(echoed) == num_choices:
                return
    finally:
        await aclose(chunks)
