"""Request bodies of POST /v1/completions and /v1/chat/completions as frozen dataclasses.

1. `decode_json_body` turns the raw body into a JSON object (400 when it is not one).
2. `parse_completion_request` / `parse_chat_request` read every supported OpenAI field (plus vLLM's
   `ignore_eos`, `top_k` and `priority`), check types and ranges, and return a frozen request; the first bad
   field raises `ApiError(400, param=<field>)`; an unknown model raises 404 `model_not_found`.
Fields keep their wire names (`stream`, `include_usage`, `logprobs`) so they read like the API docs.
Unknown fields are ignored, as OpenAI-compatible servers do; fields that would change the output in a way
this server cannot honour (`n` > 1, `best_of` > 1, `echo`, `suffix`, `tools`) are rejected.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mooncaked.api.errors import ApiError, invalid_field, model_not_found
from mooncaked.api.fields import (
    check_text, is_int, json_type, read_bool, read_float, read_int, read_stop, read_str, read_token_ids,
)
from mooncaked.api.tenants import Tenant

MAX_STOP_SEQUENCES = 16
MAX_LOGPROBS = 20
MAX_CACHE_SALT_CHARS = 1024
MAX_SEED = 2**63 - 1  # a torch generator's seed
MAX_TOP_K = 1 << 20  # more than any vocabulary holds: a larger top_k would mean nothing more
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
MIN_PRIORITY, MAX_PRIORITY = -(2**31), 2**31 - 1  # `priority` is an int32, as vLLM's
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


@dataclass(frozen=True)
class SamplingOptions:
    max_tokens: int | None  # None: until the model's context is full
    temperature: float
    top_p: float
    top_k: int  # 0: disabled
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool


@dataclass(frozen=True)
class CompletionRequest:
    request_id: str
    model: str
    prompt: str | tuple[int, ...]  # text, or token ids
    sampling: SamplingOptions
    stream: bool
    include_usage: bool
    logprobs: int | None  # alternatives per token; None: no logprobs
    client_id: str = ""  # who sent it: a digest of the API key ("" without keys), never the key itself
    cache_salt: str | None = None  # vLLM's: requests with different salts never share KV
    tenant: Tenant | None = None  # the caller's tenant (None: tenants are not configured)
    priority: int = 0  # lower runs first within its class (vLLM's `priority`)
    is_batch: bool = False  # a Batch API line (the batch class), never an HTTP request

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class ChatRequest:
    request_id: str
    model: str
    messages: tuple[ChatMessage, ...]
    sampling: SamplingOptions
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int
    client_id: str = ""  # who sent it: a digest of the API key ("" without keys), never the key itself
    cache_salt: str | None = None  # vLLM's: requests with different salts never share KV
    tenant: Tenant | None = None  # the caller's tenant (None: tenants are not configured)
    priority: int = 0  # lower runs first within its class (vLLM's `priority`)
    is_batch: bool = False  # a Batch API line (the batch class), never an HTTP request

    @property
    def num_logprobs(self) -> int | None:
        return self.top_logprobs if self.logprobs else None


def decode_json_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError(400, "The request body is not valid JSON: it is nested too deeply; send a JSON object.") \
            from None
    except ValueError as exc:  # not JSON, not UTF-8, or an integer of more digits than Python converts
        raise ApiError(400, f"The request body is not valid JSON: {exc}; send a JSON object.") from exc
    if not isinstance(body, dict):
        raise ApiError(400, f"The request body must be a JSON object, got {json_type(body)}.")
    return body


def parse_completion_request(
    body: Mapping[str, Any], *, request_id: str, model_ids: Sequence[str], client_id: str = "",
    tenant: Tenant | None = None
) -> CompletionRequest:
    _reject_unsupported(body)
    if body.get("echo") not in (None, False):
        raise invalid_field("echo", "echo is not supported")
    if body.get("suffix") is not None:
        raise invalid_field("suffix", "suffix is not supported")
    stream = read_bool(body, "stream", False)
    return CompletionRequest(
        request_id=request_id,
        model=_read_model(body, model_ids),
        prompt=_read_prompt(body),
        sampling=_read_sampling(body, read_int(body, "max_tokens", DEFAULT_COMPLETION_MAX_TOKENS, lo=1)),
        stream=stream,
        include_usage=_read_include_usage(body, stream),
        logprobs=read_int(body, "logprobs", None, lo=0, hi=MAX_LOGPROBS),
        client_id=client_id,
        cache_salt=_read_cache_salt(body),
        tenant=tenant,
        priority=_read_priority(body),
    )


def parse_chat_request(body: Mapping[str, Any], *, request_id: str, model_ids: Sequence[str],
                       client_id: str = "", tenant: Tenant | None = None) -> ChatRequest:
    _reject_unsupported(body)
    if body.get("tools"):
        raise invalid_field("tools", "tool calling is not supported")
    stream = read_bool(body, "stream", False)
    max_tokens = read_int(body, "max_tokens", None, lo=1)
    max_tokens = read_int(body, "max_completion_tokens", max_tokens, lo=1)
    logprobs = read_bool(body, "logprobs", False)
    top_logprobs = read_int(body, "top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if top_logprobs is not None and not logprobs:
        raise invalid_field("top_logprobs", "top_logprobs needs logprobs set to true")
    return ChatRequest(
        request_id=request_id,
        model=_read_model(body, model_ids),
        messages=_read_messages(body),
        sampling=_read_sampling(body, max_tokens),
        stream=stream,
        include_usage=_read_include_usage(body, stream),
        logprobs=logprobs,
        top_logprobs=top_logprobs or 0,
        client_id=client_id,
        cache_salt=_read_cache_salt(body),
        tenant=tenant,
        priority=_read_priority(body),
    )


def _read_cache_salt(body: Mapping[str, Any]) -> str | None:
    salt = read_str(body, "cache_salt")
    if salt is not None and not 1 <= len(salt) <= MAX_CACHE_SALT_CHARS:
        raise invalid_field("cache_salt", f"cache_salt must be a non-empty string of at most "
                            f"{MAX_CACHE_SALT_CHARS} characters")
    return salt


def _reject_unsupported(body: Mapping[str, Any]) -> None:
    read_int(body, "n", 1, lo=1, hi=1)
    read_int(body, "best_of", 1, lo=1, hi=1)
    read_str(body, "user")


def _read_priority(body: Mapping[str, Any]) -> int:
    priority = read_int(body, "priority", 0, lo=MIN_PRIORITY, hi=MAX_PRIORITY)
    assert priority is not None
    return priority


def _read_model(body: Mapping[str, Any], model_ids: Sequence[str]) -> str:
    model = read_str(body, "model")
    if model is None:
        if not model_ids:
            raise ApiError(503, "No model is being served yet; retry shortly.", code="service_unavailable")
        return model_ids[0]
    if model not in model_ids:
        raise model_not_found(model)
    return model


def _read_sampling(body: Mapping[str, Any], max_tokens: int | None) -> SamplingOptions:
    top_k = read_int(body, "top_k", 0, lo=-1, hi=MAX_TOP_K)
    return SamplingOptions(
        max_tokens=max_tokens,
        temperature=read_float(body, "temperature", 1.0, lo=0.0, hi=2.0),
        top_p=read_float(body, "top_p", 1.0, lo=0.0, hi=1.0, is_lo_open=True),
        top_k=max(0, top_k or 0),
        seed=read_int(body, "seed", None, lo=0, hi=MAX_SEED),
        stop=read_stop(body, MAX_STOP_SEQUENCES),
        ignore_eos=read_bool(body, "ignore_eos", False),
    )


def _read_include_usage(body: Mapping[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise invalid_field("stream_options", "stream_options is only allowed when stream is true")
    if not isinstance(options, dict):
        raise invalid_field("stream_options", f"expected an object, got {json_type(options)}")
    value = options.get("include_usage")
    if value is not None and not isinstance(value, bool):
        raise invalid_field("stream_options.include_usage", f"expected true or false, got {json_type(value)}")
    return bool(value)


def _read_prompt(body: Mapping[str, Any]) -> str | tuple[int, ...]:
    prompt = body.get("prompt")
    if prompt is None:
        raise invalid_field("prompt", "the prompt is required")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise invalid_field("prompt", "the prompt is empty")
        return check_text(prompt, "prompt")
    if isinstance(prompt, list):
        if prompt and not all(is_int(item) for item in prompt):
            raise invalid_field("prompt", "one prompt per request: a string or a list of token ids")
        return read_token_ids(prompt, "prompt")
    raise invalid_field("prompt", f"expected a string or a list of token ids, got {json_type(prompt)}")


def _read_messages(body: Mapping[str, Any]) -> tuple[ChatMessage, ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid_field("messages", "expected a non-empty list of {role, content} objects")
    return tuple(_read_message(message, f"messages[{i}]") for i, message in enumerate(messages))


def _read_message(message: object, param: str) -> ChatMessage:
    if not isinstance(message, dict):
        raise invalid_field(param, f"expected an object, got {json_type(message)}")
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise invalid_field(f"{param}.role", f"expected one of {sorted(CHAT_ROLES)}, got {role!r}")
    content = message.get("content")
    if content is None and role == "assistant":
        return ChatMessage(role=role, content="")
    return ChatMessage(role=role, content=_read_content(content, f"{param}.content"))


def _read_content(content: object, param: str) -> str:
    if isinstance(content, str):
        return check_text(content, param)
    if not isinstance(content, list):
        raise invalid_field(param, f"expected a string or a list of text parts, got {json_type(content)}")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise invalid_field(f"{param}[{j}]", "only parts of type 'text' are supported")
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid_field(f"{param}[{j}].text", f"expected a string, got {json_type(text)}")
        texts.append(check_text(text, f"{param}[{j}].text"))
    return "\n".join(texts)
