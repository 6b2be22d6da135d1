"""A chat answer with tools, as the client sees it: the model's text split into content and tool calls
(docs/api.md#tool-calling).

1. `tool_grammar(model, tool_use)` is the grammar a `required` or named tool_choice constrains the answer with:
   calls in the model family's format, each call's arguments following its tool's parameters.
2. `with_tool_calls(chunks, model)` wraps a request's chunks: each text delta goes through the family's parser
   (model/tool_parser.py); what it completes leaves as `tool_calls` (ids made here unless the format writes
   them), the rest as content; an answer that ended naturally with calls finishes with "tool_calls".
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import AsyncIterator

from mooncaked.api.backend import GenerationChunk, ToolCallOut
from mooncaked.api.tools import ToolUse
from mooncaked.model.tool_formats import ParsedCall, ToolDef
from mooncaked.model.tool_parser import ToolCallParser
from mooncaked.roles.conductor.frontend import ModelFrontend
from mooncaked.runtime.aio import aclose

FINISH_TOOL_CALLS = "tool_calls"


def tool_grammar(model: ModelFrontend, tool_use: ToolUse) -> str:
    tools = [ToolDef(tool.name, json.loads(tool.parameters)) for tool in tool_use.forced_tools]
    return model.tool_format.grammar(tools, tool_use.is_parallel, model.tool_marker_ids)


async def with_tool_calls(chunks: AsyncIterator[GenerationChunk],
                          model: ModelFrontend) -> AsyncIterator[GenerationChunk]:
    parsers: dict[int, ToolCallParser] = {}  # per choice (n > 1)
    try:
        async for chunk in chunks:
            parser = parsers.setdefault(chunk.index, ToolCallParser(model.tool_format))
            content, calls = parser.feed(chunk.text)
            if chunk.finish_reason is not None:
                rest, last = parser.finish()
                content, calls = content + rest, calls + last
            first = parser.num_calls - len(calls)
            finish = chunk.finish_reason
            if finish == "stop" and parser.num_calls:
                finish = FINISH_TOOL_CALLS
            yield dataclasses.replace(chunk, text=content, finish_reason=finish,
                                      tool_calls=tuple(_out(first + i, call) for i, call in enumerate(calls)))
    finally:
        await aclose(chunks)


def _out(index: int, call: ParsedCall) -> ToolCallOut:
    return ToolCallOut(index, call.id or f"call_{uuid.uuid4().hex[:24]}", call.name, call.arguments)
