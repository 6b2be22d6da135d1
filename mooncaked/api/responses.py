"""JSON of completion and chat-completion responses, streamed chunk by chunk or aggregated.

1. The app makes one `ResponseBuilder` per request, with its number of choices (one per prompt of a completion,
   times `n`).
2. Every `GenerationChunk` goes through `add(chunk)`, which returns the SSE chunk JSON for it (used when
   streaming) and accumulates its choice's text, logprobs, finish reason and token counts; `is_done` once every
   choice has finished.
3. At the end: `usage_chunk()` (streaming with `include_usage`) or `final_response()` (not streaming).
The shapes follow OpenAI's (and vLLM's): ids `cmpl-...` / `chatcmpl-...`, objects `text_completion`,
`chat.completion.chunk`, `chat.completion`; a chat choice's first chunk carries `role: assistant`. A chat answer's
tool calls go out as `delta.tool_calls` (each whole: id, name and arguments in one delta) and `message.tool_calls`,
its content then null when it has none; a thinking model's reasoning as `delta.reasoning_content` and
`message.reasoning_content`, as vLLM and SGLang send it. A completion with `echo` starts with its prompt's text
(and, with `logprobs`, the prompt tokens' logprobs, the first null); vLLM's `prompt_logprobs` come as a list per
choice (completions) or for the response (chat), the first entry null. Usage counts each prompt once and every
choice's tokens.
"""

from __future__ import annotations

import time
from typing import Any

from mooncaked.api.backend import GenerationChunk, PromptLogprob, TokenLogprob, ToolCallOut
from mooncaked.api.requests import ChatRequest, CompletionRequest


class _Choice:
    """One choice's accumulated output."""

    def __init__(self) -> None:
        self.text_parts: list[str] = []
        self.num_text_chars = 0
        self.chat_logprobs: list[Any] = []
        self.completion_logprobs: dict[str, list[Any]] = {
            "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        self.num_completion_tokens = 0
        self.finish_reason: str | None = None
        self.is_role_sent = False
        self.tool_calls: list[dict[str, Any]] = []
        self.reasoning_parts: list[str] = []
        self.prompt_logprobs: list[Any] | None = None


class ResponseBuilder:
    """Owns one request's accumulated output: per choice text, logprobs, counts and finish reason."""

    def __init__(self, request: CompletionRequest | ChatRequest, *, created: int | None = None,
                 num_choices: int = 1, choices_per_prompt: int = 1, response_id: str | None = None) -> None:
        """`request`: the (first) request of the answer; `response_id`: the HTTP request's id when it is not
        `request.request_id` (a completion of several prompts)."""
        self.request = request
        self.request_id = response_id or request.request_id
        self.is_chat = isinstance(request, ChatRequest)
        self.is_echo = isinstance(request, CompletionRequest) and request.echo
        self.response_id = ("chatcmpl-" if self.is_chat else "cmpl-") + self.request_id
        self.created = int(time.time()) if created is None else created
        self.choices = [_Choice() for _ in range(num_choices)]
        self.choices_per_prompt = choices_per_prompt
        self.prompt_tokens: dict[int, int] = {}  # per prompt (choice index // choices_per_prompt)
        self.cached_tokens: dict[int, int] = {}

    @property
    def is_done(self) -> bool:
        return all(choice.finish_reason is not None for choice in self.choices)

    @property
    def num_completion_tokens(self) -> int:
        return sum(choice.num_completion_tokens for choice in self.choices)

    @property
    def finish_reason(self) -> str | None:
        """The first choice's (a request of one choice: the request's)."""
        return self.choices[0].finish_reason

    def add(self, chunk: GenerationChunk) -> dict[str, Any]:
        """Accumulate `chunk`; return its streaming JSON."""
        state = self.choices[chunk.index]
        prompt = chunk.index // self.choices_per_prompt
        state.num_completion_tokens += len(chunk.token_ids)
        self.prompt_tokens[prompt] = max(self.prompt_tokens.get(prompt, 0), chunk.num_prompt_tokens)
        self.cached_tokens[prompt] = max(self.cached_tokens.get(prompt, 0), chunk.num_cached_tokens)
        state.finish_reason = chunk.finish_reason or state.finish_reason
        text = (chunk.echo_text if self.is_echo else "") + chunk.text
        logprobs = None
        if self.request.num_logprobs is not None:
            echoed = chunk.prompt_logprobs if self.is_echo and chunk.prompt_logprobs is not None else ()
            logprobs = self._logprobs_json(state, echoed, chunk.logprobs)
        if chunk.prompt_logprobs is not None and self.request.prompt_logprobs is not None:
            state.prompt_logprobs = [_vllm_prompt_logprob(item) for item in chunk.prompt_logprobs]
        state.text_parts.append(text)
        state.num_text_chars += len(text)
        choice: dict[str, Any] = {"index": chunk.index}
        if self.is_chat:
            choice["delta"] = self._delta(state, chunk)
        else:
            choice["text"] = text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = chunk.finish_reason
        if state.prompt_logprobs is not None and chunk.prompt_logprobs is not None:
            choice["prompt_logprobs"] = state.prompt_logprobs
        body = self._envelope(self._chunk_object(), [choice])
        if self.request.include_usage:
            body["usage"] = None
        return body

    def usage(self) -> dict[str, Any]:
        num_prompt_tokens = sum(self.prompt_tokens.values())
        return {
            "prompt_tokens": num_prompt_tokens,
            "completion_tokens": self.num_completion_tokens,
            "total_tokens": num_prompt_tokens + self.num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens.values())},
        }

    def usage_chunk(self) -> dict[str, Any]:
        body = self._envelope(self._chunk_object(), [])
        body["usage"] = self.usage()
        return body

    def final_response(self) -> dict[str, Any]:
        choices = [self._final_choice(index, state) for index, state in enumerate(self.choices)]
        body = self._envelope("chat.completion" if self.is_chat else "text_completion", choices)
        if self.is_chat and self.choices[0].prompt_logprobs is not None:
            body["prompt_logprobs"] = self.choices[0].prompt_logprobs  # vLLM's place for a chat's
        body["usage"] = self.usage()
        return body

    def _final_choice(self, index: int, state: _Choice) -> dict[str, Any]:
        text = "".join(state.text_parts)
        choice: dict[str, Any] = {"index": index}
        if self.is_chat:
            message: dict[str, Any] = {
                "role": "assistant", "content": text or (None if state.tool_calls or state.reasoning_parts else "")}
            if state.tool_calls:
                message["tool_calls"] = state.tool_calls
            if state.reasoning_parts:
                message["reasoning_content"] = "".join(state.reasoning_parts)
            choice["message"] = message
            logprobs: Any = {"content": state.chat_logprobs}
        else:
            choice["text"] = text
            logprobs = state.completion_logprobs
            if state.prompt_logprobs is not None:
                choice["prompt_logprobs"] = state.prompt_logprobs
        choice["logprobs"] = logprobs if self.request.num_logprobs is not None else None
        choice["finish_reason"] = state.finish_reason
        return choice

    def _delta(self, state: _Choice, chunk: GenerationChunk) -> dict[str, Any]:
        delta: dict[str, Any] = {"content": chunk.text} if chunk.text or not (chunk.tool_calls or chunk.reasoning) \
            else {}
        if chunk.reasoning:
            delta["reasoning_content"] = chunk.reasoning
            state.reasoning_parts.append(chunk.reasoning)
        if chunk.tool_calls:
            calls = [_tool_call_json(call) for call in chunk.tool_calls]
            state.tool_calls.extend(calls)
            delta["tool_calls"] = [{"index": call.index, **json} for call, json in zip(chunk.tool_calls, calls)]
        if not state.is_role_sent:
            delta = {"role": "assistant", **delta}
            state.is_role_sent = True
        return delta

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.is_chat else "text_completion"

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.response_id, "object": obj, "created": self.created,
            "model": self.request.model, "choices": choices,
        }

    def _logprobs_json(self, state: _Choice, echoed: tuple[PromptLogprob, ...],
                       logprobs: tuple[TokenLogprob, ...] | None) -> dict[str, Any]:
        items = logprobs or ()
        if self.is_chat:
            content = [_chat_logprob(item) for item in items]
            state.chat_logprobs.extend(content)
            return {"content": content}
        part: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = state.num_text_chars
        rows = [(p.token, p.logprob, None if p.logprob is None else {**{t: lp for _, t, lp in p.top},
                                                                      p.token: p.logprob}) for p in echoed]
        rows += [(item.token, item.logprob, dict(item.top_logprobs)) for item in items]
        for token, logprob, top in rows:
            part["tokens"].append(token)
            part["token_logprobs"].append(logprob)
            part["top_logprobs"].append(top)
            part["text_offset"].append(offset)
            offset += len(token)
        for key, values in part.items():
            state.completion_logprobs[key].extend(values)
        return part


def _tool_call_json(call: ToolCallOut) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _vllm_prompt_logprob(item: PromptLogprob) -> dict[str, Any] | None:
    """vLLM's shape: token id -> {logprob, rank, decoded_token}, the prompt's token and the most likely ones."""
    if item.logprob is None:
        return None
    entries = {str(token_id): {"logprob": logprob, "rank": rank + 1, "decoded_token": token}
               for rank, (token_id, token, logprob) in enumerate(item.top)}
    entries[str(item.token_id)] = {"logprob": item.logprob, "rank": item.rank, "decoded_token": item.token}
    return entries


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
