"""Hypothesis strategies for hostile OpenAI requests: arbitrary JSON values (any code point in strings, NaN and
infinities, big integers, any nesting) at the top level and at every field of a valid request, and raw bodies
that are not JSON at all. Shared by the HTTP-layer tests and the live-conductor tests."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

COMPLETION_FIELDS = ("model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
                     "stream_options", "logprobs", "n", "best_of", "echo", "suffix", "ignore_eos", "user")
CHAT_FIELDS = ("model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
               "stop", "stream", "stream_options", "logprobs", "top_logprobs", "n", "tools", "ignore_eos", "user")
SAMPLING_CONTROLS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias",
                     "stop_token_ids", "min_tokens", "response_format", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar", "structured_outputs")

any_text = st.text(st.characters(codec=None), max_size=24)  # every code point, lone surrogates included
scalars = (st.none() | st.booleans() | st.integers() | st.integers(-2**70, 2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | any_text)
json_values = st.recursive(
    scalars, lambda children: st.lists(children, max_size=4) | st.dictionaries(any_text, children, max_size=4),
    max_leaves=16)


def base_completion(model: str, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "prompt": "hello there", "max_tokens": max_tokens}


def base_chat(model: str, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": max_tokens}


@st.composite
def mutated_bodies(draw: st.DrawFn, model: str, max_tokens: int = 4) -> tuple[str, dict[str, Any]]:
    """(route, body): a valid request of either kind with one to three of its fields set to arbitrary JSON,
    or nested fields (a message, a stop list, stream_options) given arbitrary members."""
    is_chat = draw(st.booleans())
    route = "/v1/chat/completions" if is_chat else "/v1/completions"
    body = base_chat(model, max_tokens) if is_chat else base_completion(model, max_tokens)
    fields = (CHAT_FIELDS if is_chat else COMPLETION_FIELDS) + SAMPLING_CONTROLS
    for name in draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True)):
        body[name] = draw(json_values)
    if is_chat and draw(st.booleans()):
        body["messages"] = [draw(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"])
                                                                 | any_text, "content": json_values}))]
    if draw(st.booleans()):
        body["stream"], body["stream_options"] = True, {"include_usage": draw(json_values)}
    return route, body


def encode(body: Any) -> bytes:
    """JSON as Python writes it: NaN and Infinity included, lone surrogates escaped."""
    return json.dumps(body).encode()


deep_nesting = st.builds(lambda depth, is_array: (("[" * depth + "]" * depth) if is_array
                                                  else ('{"a":' * depth + "1" + "}" * depth)).encode(),
                         st.integers(1, 200_000), st.booleans())
raw_bodies = st.one_of(st.binary(max_size=256), json_values.map(encode), deep_nesting,
                       any_text.map(lambda text: text.encode("utf-8", "surrogatepass")))
