"""Every field the two generation routes know, and what the server does with it: docs/api.md's field table.

1. `FIELDS` names each field with the routes that take it and its `use`: `honoured` (it does what OpenAI or vLLM
   documents), `partly` (the values docs/api.md names are honoured; any other is a 400 naming the field),
   `accepted` (checked, and without effect on the output, for the reason docs/api.md gives) or `refused` (any
   value but null is a 400 naming it).
2. `check_known_fields(body, route)` answers a field the route does not know with a 400 naming it, as OpenAI does
   ("Unrecognized request argument"): nothing a client sends is dropped in silence. The values of known fields
   are checked where they are read (requests.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mooncaked.api.errors import invalid_field
from mooncaked.api.fields import read_str

COMPLETIONS = "completions"
CHAT = "chat"
HONOURED, PARTLY, ACCEPTED, REFUSED = "honoured", "partly", "accepted", "refused"
BOTH = frozenset({COMPLETIONS, CHAT})
MAX_METADATA_KEYS = 16  # OpenAI's limit


@dataclass(frozen=True)
class FieldUse:
    routes: frozenset[str]
    use: str  # HONOURED, PARTLY, ACCEPTED or REFUSED


def _on(routes: frozenset[str] | str, use: str) -> FieldUse:
    return FieldUse(routes if isinstance(routes, frozenset) else frozenset({routes}), use)


FIELDS: dict[str, FieldUse] = {
    # OpenAI's, on both routes
    "model": _on(BOTH, HONOURED),
    "frequency_penalty": _on(BOTH, HONOURED),
    "logit_bias": _on(BOTH, HONOURED),
    "logprobs": _on(BOTH, HONOURED),
    "max_tokens": _on(BOTH, HONOURED),
    "n": _on(BOTH, HONOURED),
    "presence_penalty": _on(BOTH, HONOURED),
    "seed": _on(BOTH, HONOURED),
    "stop": _on(BOTH, HONOURED),
    "stream": _on(BOTH, HONOURED),
    "stream_options": _on(BOTH, PARTLY),
    "temperature": _on(BOTH, HONOURED),
    "top_p": _on(BOTH, HONOURED),
    "user": _on(BOTH, ACCEPTED),
    # OpenAI's completions only
    "prompt": _on(COMPLETIONS, HONOURED),
    "best_of": _on(COMPLETIONS, HONOURED),
    "echo": _on(COMPLETIONS, HONOURED),
    "suffix": _on(COMPLETIONS, REFUSED),
    # OpenAI's chat only
    "messages": _on(CHAT, PARTLY),
    "audio": _on(CHAT, REFUSED),
    "function_call": _on(CHAT, REFUSED),
    "functions": _on(CHAT, REFUSED),
    "max_completion_tokens": _on(CHAT, HONOURED),
    "metadata": _on(CHAT, ACCEPTED),
    "modalities": _on(CHAT, PARTLY),
    "parallel_tool_calls": _on(CHAT, HONOURED),
    "prediction": _on(CHAT, REFUSED),
    "prompt_cache_key": _on(CHAT, ACCEPTED),
    "reasoning_effort": _on(CHAT, REFUSED),
    "safety_identifier": _on(CHAT, ACCEPTED),
    "service_tier": _on(CHAT, PARTLY),
    "store": _on(CHAT, PARTLY),
    "tool_choice": _on(CHAT, HONOURED),
    "tools": _on(CHAT, HONOURED),
    "top_logprobs": _on(CHAT, HONOURED),
    "verbosity": _on(CHAT, PARTLY),
    "web_search_options": _on(CHAT, REFUSED),
    # vLLM's, on both routes
    "top_k": _on(BOTH, HONOURED),
    "min_p": _on(BOTH, HONOURED),
    "repetition_penalty": _on(BOTH, HONOURED),
    "min_tokens": _on(BOTH, HONOURED),
    "stop_token_ids": _on(BOTH, HONOURED),
    "ignore_eos": _on(BOTH, HONOURED),
    "include_stop_str_in_output": _on(BOTH, HONOURED),
    "skip_special_tokens": _on(BOTH, HONOURED),
    "priority": _on(BOTH, HONOURED),
    "cache_salt": _on(BOTH, HONOURED),
    # structured outputs (structured.py): OpenAI's response_format, also on completions as vLLM takes it, and vLLM's
    "response_format": _on(BOTH, HONOURED),
    "guided_json": _on(BOTH, HONOURED),
    "guided_regex": _on(BOTH, HONOURED),
    "guided_choice": _on(BOTH, HONOURED),
    "guided_grammar": _on(BOTH, HONOURED),
    "structured_outputs": _on(BOTH, HONOURED),
    # vLLM's, chat only
    "chat_template_kwargs": _on(CHAT, HONOURED),
    "prompt_logprobs": _on(BOTH, HONOURED),
}


def route_fields(route: str) -> frozenset[str]:
    return frozenset(name for name, field in FIELDS.items() if route in field.routes)


def check_known_fields(body: Mapping[str, Any], route: str) -> None:
    known = route_fields(route)
    for name in body:
        if name not in known:
            other = CHAT if route == COMPLETIONS else COMPLETIONS
            hint = f" (it belongs to /v1/{'chat/completions' if other == CHAT else 'completions'})" \
                if name in route_fields(other) else ""
            raise invalid_field(name, f"unrecognized request argument {name!r}{hint}; docs/api.md lists every "
                                "field this route takes")


def refuse_set(body: Mapping[str, Any], name: str, why: str) -> None:
    """A 400 naming `name` when the body sets it (null counts as unset)."""
    if body.get(name) is not None:
        raise invalid_field(name, why)


def check_chat_options(body: Mapping[str, Any]) -> None:
    """The chat fields that change nothing this server does, or only in part: refused, partly, accepted."""
    for name, why in (("audio", "audio output is not supported; ask for text"),
                      ("function_call", "the deprecated function calling is not supported: send tool_choice"),
                      ("functions", "the deprecated function calling is not supported: send tools"),
                      ("prediction", "predicted outputs are not supported"),
                      ("reasoning_effort", "the served model has no reasoning effort setting"),
                      ("web_search_options", "web search is not supported")):
        refuse_set(body, name, why)
    _check_one_of(body, "modalities", (["text"],), "only text output is supported: send [\"text\"] or leave it out")
    _check_one_of(body, "service_tier", ("auto", "default"), "only \"auto\" and \"default\" are served")
    _check_one_of(body, "store", (False,), "completions are not stored: send false or leave it out")
    _check_one_of(body, "verbosity", ("medium",), "only the default \"medium\" is served")
    for name in ("prompt_cache_key", "safety_identifier"):
        read_str(body, name)
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_KEYS:
            raise invalid_field("metadata", f"expected an object of at most {MAX_METADATA_KEYS} string values")
        if not all(isinstance(value, str) for value in metadata.values()):
            raise invalid_field("metadata", "every metadata value must be a string")


def _check_one_of(body: Mapping[str, Any], name: str, allowed: tuple[Any, ...], why: str) -> None:
    value = body.get(name)
    if value is not None and not any(type(value) is type(a) and value == a for a in allowed):
        raise invalid_field(name, why)
