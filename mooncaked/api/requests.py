"""Request bodies of POST /v1/completions and /v1/chat/completions as frozen dataclasses.

1. `decode_json_body` turns the raw body into a JSON object (400 when it is not one).
2. `parse_completion_request` / `parse_chat_request` first refuse any field the route does not know
   (request_fields.py: docs/api.md's field table), then read every field, check types and ranges, and return a
   frozen request; the first bad field raises `ApiError(400, param=<field>)`; an unknown model raises 404
   `model_not_found`. A value this server cannot honour (`n` > 1, `echo`, `suffix`, ...) is a 400 naming the
   field, never dropped.
Fields keep their wire names (`stream`, `include_usage`, `logprobs`) so they read like the API docs.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mooncaked.api.chat_messages import ChatMessage, read_messages
from mooncaked.api.errors import ApiError, invalid_field, model_not_found
from mooncaked.api.fields import check_text, is_int, json_type, read_bool, read_int, read_str, read_token_ids
from mooncaked.api.request_fields import CHAT, COMPLETIONS, check_chat_options, check_known_fields, refuse_set
from mooncaked.api.sampling_options import SamplingOptions, read_sampling
from mooncaked.api.structured import OutputConstraint, read_constraint
from mooncaked.api.tenants import Tenant
from mooncaked.api.tools import ToolUse, read_tools

MAX_LOGPROBS = 20
MAX_CACHE_SALT_CHARS = 1024
STREAM_OPTIONS = frozenset({"include_usage", "include_obfuscation"})
MAX_PROMPTS = 256  # prompts in one completion request
MAX_N = 16  # n and best_of: sequences sampled from one prompt
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
MIN_PRIORITY, MAX_PRIORITY = -(2**31), 2**31 - 1  # `priority` is an int32, as vLLM's


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
    constraint: OutputConstraint | None = None  # structured outputs: what the output must match
    echo: bool = False  # the answer starts with the prompt (and its logprobs, with `logprobs`)
    prompt_logprobs: int | None = None  # vLLM's: the prompt tokens' logprobs with this many alternatives
    n: int = 1  # choices answering the prompt (parallel sampling: one prefill)
    best_of: int | None = None  # sequences sampled, the n best of which are returned (None: n)

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_sequences(self) -> int:
        return max(self.n, self.best_of or self.n)

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token the prefill must compute (None: no prompt logprobs)."""
        asked = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        return max(asked) if asked else None


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
    constraint: OutputConstraint | None = None  # structured outputs: what the output must match
    tool_use: ToolUse = ToolUse()  # the tools it may call, and how
    template_kwargs: tuple[tuple[str, Any], ...] = ()  # vLLM's chat_template_kwargs: more variables for the template
    prompt_logprobs: int | None = None  # vLLM's: the prompt tokens' logprobs with this many alternatives
    n: int = 1  # choices (parallel sampling: one prefill)

    @property
    def num_logprobs(self) -> int | None:
        return self.top_logprobs if self.logprobs else None

    @property
    def num_sequences(self) -> int:
        return self.n

    @property
    def num_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs


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


def parse_completion_requests(
    body: Mapping[str, Any], *, request_id: str, model_ids: Sequence[str], client_id: str = "",
    tenant: Tenant | None = None
) -> list[CompletionRequest]:
    """One request per prompt of `prompt` (a list of several prompts: one choice each, as OpenAI and vLLM take
    it); several get the ids `<request_id>-<i>`."""
    prompts = _read_prompts(body)
    first = parse_completion_request({**body, "prompt": prompts[0]}, request_id=request_id, model_ids=model_ids,
                                     client_id=client_id, tenant=tenant)
    if len(prompts) == 1:
        return [first]
    return [dataclasses.replace(first, request_id=f"{request_id}-{i}",
                                prompt=_read_prompt({"prompt": prompt}, f"prompt[{i}]"))
            for i, prompt in enumerate(prompts)]


def parse_completion_request(
    body: Mapping[str, Any], *, request_id: str, model_ids: Sequence[str], client_id: str = "",
    tenant: Tenant | None = None
) -> CompletionRequest:
    check_known_fields(body, COMPLETIONS)
    _reject_unsupported(body)
    refuse_set(body, "suffix", "suffix is not supported")
    stream = read_bool(body, "stream", False)
    n = _read_n(body)
    best_of = read_int(body, "best_of", None, lo=n, hi=MAX_N)
    if best_of is not None and best_of > n and stream:
        raise invalid_field("best_of", "best_of more than n cannot be streamed (the best are known at the end)")
    echo = read_bool(body, "echo", False)
    max_tokens = read_int(body, "max_tokens", DEFAULT_COMPLETION_MAX_TOKENS, lo=0 if echo else 1)
    return CompletionRequest(
        request_id=request_id,
        model=_read_model(body, model_ids),
        prompt=_read_prompt(body),
        sampling=read_sampling(body, max_tokens),
        stream=stream,
        include_usage=_read_include_usage(body, stream),
        logprobs=read_int(body, "logprobs", None, lo=0, hi=MAX_LOGPROBS),
        client_id=client_id,
        cache_salt=_read_cache_salt(body),
        tenant=tenant,
        priority=_read_priority(body),
        constraint=read_constraint(body),
        echo=echo,
        prompt_logprobs=read_int(body, "prompt_logprobs", None, lo=0, hi=MAX_LOGPROBS),
        n=n,
        best_of=best_of,
    )


def parse_chat_request(body: Mapping[str, Any], *, request_id: str, model_ids: Sequence[str],
                       client_id: str = "", tenant: Tenant | None = None) -> ChatRequest:
    check_known_fields(body, CHAT)
    _reject_unsupported(body)
    check_chat_options(body)
    stream = read_bool(body, "stream", False)
    max_tokens = read_int(body, "max_tokens", None, lo=1)
    max_tokens = read_int(body, "max_completion_tokens", max_tokens, lo=1)
    logprobs = read_bool(body, "logprobs", False)
    top_logprobs = read_int(body, "top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if top_logprobs is not None and not logprobs:
        raise invalid_field("top_logprobs", "top_logprobs needs logprobs set to true")
    tool_use, constraint = read_tools(body), read_constraint(body)
    if tool_use.is_enabled and constraint is not None:
        raise invalid_field(constraint.param, "an output constraint and tools cannot both shape one answer; send "
                            "tool_choice \"none\" or leave one out")
    return ChatRequest(
        request_id=request_id,
        model=_read_model(body, model_ids),
        messages=read_messages(body),
        sampling=read_sampling(body, max_tokens),
        stream=stream,
        include_usage=_read_include_usage(body, stream),
        logprobs=logprobs,
        top_logprobs=top_logprobs or 0,
        client_id=client_id,
        cache_salt=_read_cache_salt(body),
        tenant=tenant,
        priority=_read_priority(body),
        constraint=constraint,
        tool_use=tool_use,
        template_kwargs=read_template_kwargs(body),
        prompt_logprobs=read_int(body, "prompt_logprobs", None, lo=0, hi=MAX_LOGPROBS),
        n=_read_n(body),
    )


def read_template_kwargs(body: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """vLLM's `chat_template_kwargs`: variables the chat template reads (`enable_thinking: false`), JSON values; the
    names the server itself sets are refused."""
    value = body.get("chat_template_kwargs")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise invalid_field("chat_template_kwargs", f"expected an object, got {json_type(value)}")
    for name in value:
        if name in RESERVED_TEMPLATE_NAMES or not name.isidentifier():
            raise invalid_field(f"chat_template_kwargs.{name}", "not a variable a request may set; the server sets "
                                f"{sorted(RESERVED_TEMPLATE_NAMES)}")
    return tuple(sorted(value.items()))


def _read_cache_salt(body: Mapping[str, Any]) -> str | None:
    salt = read_str(body, "cache_salt")
    if salt is not None and not 1 <= len(salt) <= MAX_CACHE_SALT_CHARS:
        raise invalid_field("cache_salt", f"cache_salt must be a non-empty string of at most "
                            f"{MAX_CACHE_SALT_CHARS} characters")
    return salt


def _reject_unsupported(body: Mapping[str, Any]) -> None:
    read_str(body, "user")


def _read_n(body: Mapping[str, Any]) -> int:
    n = read_int(body, "n", 1, lo=1, hi=MAX_N)
    assert n is not None
    return n


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


def _read_include_usage(body: Mapping[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise invalid_field("stream_options", "stream_options is only allowed when stream is true")
    if not isinstance(options, dict):
        raise invalid_field("stream_options", f"expected an object, got {json_type(options)}")
    for key in options:
        if key not in STREAM_OPTIONS:
            raise invalid_field(f"stream_options.{key}", f"unrecognized; stream_options takes {sorted(STREAM_OPTIONS)}")
    if read_bool(options, "include_obfuscation", False, param="stream_options.include_obfuscation"):
        raise invalid_field("stream_options.include_obfuscation", "obfuscation padding is not supported: send false")
    return read_bool(options, "include_usage", False, param="stream_options.include_usage")


def _read_prompts(body: Mapping[str, Any]) -> list[Any]:
    """`prompt` as a list of prompts: one string or token-id list, or a list of several of them."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise invalid_field("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}")
        return list(prompt)
    return [prompt]


def _read_prompt(body: Mapping[str, Any], param: str = "prompt") -> str | tuple[int, ...]:
    prompt = body.get("prompt")
    if prompt is None:
        raise invalid_field(param, "the prompt is required")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise invalid_field(param, "the prompt is empty")
        return check_text(prompt, param)
    if isinstance(prompt, list):
        if prompt and not all(is_int(item) for item in prompt):
            raise invalid_field(param, "a prompt is a string or a list of token ids; several prompts are a list "
                                "of those")
        return read_token_ids(prompt, param)
    raise invalid_field(param, f"expected a string or a list of token ids, got {json_type(prompt)}")
