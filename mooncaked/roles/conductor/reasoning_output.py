"""A thinking model's answer, as the client sees it: the reasoning block apart from the answer
(docs/api.md#reasoning; the parsing is model/reasoning.py's).

`with_reasoning(chunks, format, mode)` wraps a chat request's chunks: each text delta is split into `reasoning`
and answer text (`text`), which a tool-call parser then reads (tool_output.py), so tool calls and constraints
apply to the answer only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from mooncaked.api.backend import GenerationChunk
from mooncaked.model.reasoning import ReasoningFormat, ReasoningParser
from mooncaked.runtime.aio import aclose


async def with_reasoning(chunks: AsyncIterator[GenerationChunk], fmt: ReasoningFormat,
                         mode: str) -> AsyncIterator[GenerationChunk]:
    parsers: dict[int, ReasoningParser] = {}  # per choice (n > 1)
    try:
        async for chunk in chunks:
            parser = parsers.setdefault(chunk.index, ReasoningParser(fmt, mode))
            reasoning, answer = parser.feed(chunk.text)
            if chunk.finish_reason is not None:
                more_reasoning, more_answer = parser.finish()
                reasoning, answer = reasoning + more_reasoning, answer + more_answer
            yield dataclasses.replace(chunk, text=answer, reasoning=reasoning)
    finally:
        await aclose(chunks)
