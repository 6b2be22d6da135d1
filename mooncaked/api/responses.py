"""JSON of completion and chat-completion responses, streamed chunk by chunk or aggregated.

1. The app makes one `ResponseBuilder` per request.
2. Every `GenerationChunk` goes through `add(chunk)`, which returns the SSE chunk JSON for it (used when
   streaming) and accumulates text, logprobs, finish reason and token counts.
3. At the end: `usage_chunk()` (streaming with `include_usage`) or `final_response()` (not streaming).
The shapes follow OpenAI's (and vLLM's): ids `cmpl-...` / `chatcmpl-...`, objects `text_completion`,
`chat.completion.chunk`, `chat.completion`; the first chat chunk carries `role: assistant`. A chat answer's tool
calls go out as `delta.tool_calls` (each whole: id, name and arguments in one delta) and `message.tool_calls`, its
content then null when it has none; a thinking model's reasoning as `delta.reasoning_content` and
`message.reasoning_content`, as vLLM and SGLang send it.
"""

from __future__ import annotations

import time
from typing import Any

from mooncaked.api.backend import GenerationChunk, TokenLogprob, ToolCallOut
from mooncaked.api.requests import ChatRequest, CompletionRequest


class ResponseBuilder:
    """Owns one request's accumulated output: text, logprobs, counts and finish reason."""

    def __init__(self, request: CompletionRequest | ChatRequest, *, created: int | None = None) -> None:
        self.request = request
        self.is_chat = isinstance(request, ChatRequest)
        self.response_id = ("chatcmpl-" if self.is_chat else "cmpl-") + request.request_id
        self.created = int(time.time()) if created is None else created
        self.text_parts: list[str] = []
        self.num_text_chars = 0
        self.logprob_items: list[Any] = []
        self.completion_logprobs: dict[str, list[Any]] = {
            "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": [],
        }
        self.num_completion_tokens = 0
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None
        self.is_role_sent = False
        self.tool_calls: list[dict[str, Any]] = []
        self.reasoning_parts: list[str] = []

    def add(self, chunk: GenerationChunk) -> dict[str, Any]:
        """Accumulate `chunk`; return its streaming JSON."""
        self.num_completion_tokens += len(chunk.token_ids)
        self.num_prompt_tokens = max(self.num_prompt_tokens, chunk.num_prompt_tokens)
        self.num_cached_tokens = max(self.num_cached_tokens, chunk.num_cached_tokens)
        self.finish_reason = chunk.finish_reason or self.finish_reason
        logprobs = self._logprobs_json(chunk.logprobs) if self.request.num_logprobs is not None else None
        self.text_parts.append(chunk.text)
        self.num_text_chars += len(chunk.text)
        choice: dict[str, Any] = {"index": 0}
        if self.is_chat:
            delta: dict[str, Any] = {"content": chunk.text} if chunk.text or not (chunk.tool_calls or chunk.reasoning) \
                else {}
            if chunk.reasoning:
                delta["reasoning_content"] = chunk.reasoning
                self.reasoning_parts.append(chunk.reasoning)
            if chunk.tool_calls:
                calls = [_tool_call_json(call) for call in chunk.tool_calls]
                self.tool_calls.extend(calls)
                delta["tool_calls"] = [{"index": call.index, **json} for call, json in zip(chunk.tool_calls, calls)]
            if not self.is_role_sent:
                delta = {"role": "assistant", **delta}
                self.is_role_sent = True
            choice["delta"] = delta
        else:
            choice["text"] = chunk.text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = chunk.finish_reason
        body = self._envelope(self._chunk_object(), [choice])
        if self.request.include_usage:
            body["usage"] = None
        return body

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_completion_tokens,
            "total_tokens": self.num_prompt_tokens + self.num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens},
        }

    def usage_chunk(self) -> dict[str, Any]:
        body = self._envelope(self._chunk_object(), [])
        body["usage"] = self.usage()
        return body

    def final_response(self) -> dict[str, Any]:
        text = "".join(self.text_parts)
        choice: dict[str, Any] = {"index": 0}
        if self.is_chat:
            choice["message"] = {"role": "assistant",
                                 "content": text or (None if self.tool_calls or self.reasoning_parts else "")}
            if self.tool_calls:
                choice["message"]["tool_calls"] = self.tool_calls
            if self.reasoning_parts:
                choice["message"]["reasoning_content"] = "".join(self.reasoning_parts)
            logprobs: Any = {"content": self.logprob_items}
        else:
            choice["text"] = text
            logprobs = self.completion_logprobs
        choice["logprobs"] = logprobs if self.request.num_logprobs is not None else None
        choice["finish_reason"] = self.finish_reason
        body = self._envelope("chat.completion" if self.is_chat else "text_completion", [choice])
        body["usage"] = self.usage()
        return body

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.is_chat else "text_completion"

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.response_id, "object": obj, "created": self.created,
            "model": self.request.model, "choices": choices,
        }

    def _logprobs_json(self, logprobs: tuple[TokenLogprob, ...] | None) -> dict[str, Any]:
        items = logprobs or ()
        if self.is_chat:
            content = [_chat_logprob(item) for item in items]
            self.logprob_items.extend(content)
            return {"content": content}
        part: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = self.num_text_chars
        for item in items:
            part["tokens"].append(item.token)
            part["token_logprobs"].append(item.logprob)
            part["top_logprobs"].append(dict(item.top_logprobs))
            part["text_offset"].append(offset)
            offset += len(item.token)
        for key, values in part.items():
            self.completion_logprobs[key].extend(values)
        return part


def _tool_call_json(call: ToolCallOut) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _chat_logprob(item: TokenLogprob) -> dict[str, Any]:
    return {
        "token": item.token,
        "logprob": item.logprob,
        "bytes": list(item.token.encode("utf-8")),
        "top_logprobs": [
            {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
            for token, logprob in item.top_logprobs
        ],
    }
