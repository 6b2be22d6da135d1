"""A completion with `echo`: its answer starts with the prompt (docs/api.md#echo-and-prompt-logprobs).

`with_echo(chunks, echo_text, is_prompt_only)` puts the prompt's text on the first chunk (its prompt logprobs are
already there, from the prefill: request_run.py). With `max_tokens: 0` (what evaluation harnesses send to score a
prompt) the one token the prefill samples anyway is left out: no text, no token counted, finish "length".
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from mooncaked.api.backend import GenerationChunk
from mooncaked.runtime.aio import aclose


async def with_echo(chunks: AsyncIterator[GenerationChunk], echo_text: str,
                    is_prompt_only: bool) -> AsyncIterator[GenerationChunk]:
    is_first = True
    try:
        async for chunk in chunks:
            if is_prompt_only:
                chunk = dataclasses.replace(chunk, token_ids=(), text="", finish_reason="length",
                                            logprobs=None if chunk.logprobs is None else ())
            if is_first:
                chunk = dataclasses.replace(chunk, echo_text=echo_text)
                is_first = False
            yield chunk
            if is_prompt_only:
                return
    finally:
        await aclose(chunks)
