"""Request parsing as pure functions: accepted shapes, defaults, and the field each error names."""

from __future__ import annotations

import pytest

from mooncaked.api.chat_messages import ChatMessage
from mooncaked.api.errors import ApiError
from mooncaked.api.requests import decode_json_body, parse_chat_request, parse_completion_request
from mooncaked.api.sampling_options import MAX_TOP_K

MODELS = ["m1", "m2"]


def minimal_body(parse: object) -> dict[str, object]:
    if parse is parse_completion_request:
        return {"prompt": "x"}
    return {"messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize(("prompt", "expected"), [
    ("hi", "hi"), (["hi"], "hi"), ([1, 2, 3], (1, 2, 3)), ([[4, 5]], (4, 5)),
])
def test_prompt_shapes(prompt: object, expected: object) -> None:
    request = parse_completion_request({"prompt": prompt}, request_id="r", model_ids=MODELS)
    assert request.prompt == expected


def test_completion_defaults_follow_openai() -> None:
    request = parse_completion_request({"prompt": "x"}, request_id="r1", model_ids=MODELS)
    assert request.model == "m1" and request.request_id == "r1"
    assert request.sampling.max_tokens == 16
    assert (request.sampling.temperature, request.sampling.top_p, request.sampling.top_k) == (1.0, 1.0, 0)
    assert request.sampling.stop == () and request.sampling.seed is None and not request.sampling.ignore_eos
    assert not request.stream and not request.include_usage and request.num_logprobs is None


def test_completion_fields_read() -> None:
    request = parse_completion_request({
        "model": "m2", "prompt": "x", "max_tokens": 7, "temperature": 0, "top_p": 0.5, "top_k": -1, "seed": 3,
        "stop": "END", "stream": True, "stream_options": {"include_usage": True}, "logprobs": 0,
        "ignore_eos": True, "user": "someone",
    }, request_id="r", model_ids=MODELS)
    assert request.model == "m2"
    sampling = request.sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.top_k) == (7, 0.0, 0.5, 0)
    assert sampling.seed == 3 and sampling.stop == ("END",) and sampling.ignore_eos
    assert request.stream and request.include_usage and request.num_logprobs == 0


def test_chat_fields_read() -> None:
    request = parse_chat_request({
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None},
        ],
        "max_tokens": 5, "max_completion_tokens": 9, "logprobs": True, "top_logprobs": 3, "stop": ["x", "y"],
    }, request_id="r", model_ids=MODELS)
    assert request.messages == (ChatMessage("system", "s"), ChatMessage("user", "a\nb"), ChatMessage("assistant", ""))
    assert request.sampling.max_tokens == 9 and request.sampling.stop == ("x", "y")
    assert request.num_logprobs == 3
    default = parse_chat_request({"messages": [{"role": "user", "content": "q"}]}, request_id="r", model_ids=MODELS)
    assert default.sampling.max_tokens is None and default.num_logprobs is None


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"prompt": "x", "model": "nope"}, 404, "model"),
    ({"prompt": "x", "n": 2, "best_of": 1}, 400, "best_of"),
    ({"prompt": "x", "echo": "yes"}, 400, "echo"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ({"prompt": "x", "top_k": -2}, 400, "top_k"),
    ({"prompt": "x", "top_k": 10**30}, 400, "top_k"),  # not even an int64 on the wire
    ({"prompt": "x", "top_k": MAX_TOP_K + 1}, 400, "top_k"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": "y"}}, 400, "stream_options.include_usage"),
    ({"prompt": "x", "user": 5}, 400, "user"),
    ({"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"prompt": "x", "min_p": 1.01}, 400, "min_p"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": None}}, 400, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 1, "05": 2}}, 400, "logit_bias"),
    ({"prompt": "x", "logit_bias": [5]}, 400, "logit_bias"),
    ({"prompt": "x", "stop_token_ids": [1, -1]}, 400, "stop_token_ids"),
    ({"prompt": "x", "stop_token_ids": 3}, 400, "stop_token_ids"),
    ({"prompt": "x", "min_tokens": -1}, 400, "min_tokens"),
    ({"prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
    ({"prompt": "x", "presence_penalty": 10**400}, 400, "presence_penalty"),
])
def test_completion_errors(body: dict[str, object], status: int, param: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_completion_request(body, request_id="r", model_ids=MODELS)
    assert info.value.status == status and info.value.param == param


@pytest.mark.parametrize("parse", [parse_completion_request, parse_chat_request])
def test_sampling_controls_read_on_both_routes(parse: object) -> None:
    body = {**minimal_body(parse), "max_tokens": 8, "presence_penalty": 0.5, "frequency_penalty": -1,
            "repetition_penalty": 1.2, "min_p": 0.1, "logit_bias": {"50256": -100, "7": 2.5}, "stop_token_ids": [3, 4],
            "min_tokens": 8}
    assert callable(parse)
    sampling = parse(body, request_id="r", model_ids=MODELS).sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty) == (0.5, -1.0, 1.2)
    assert sampling.min_p == 0.1 and sampling.min_tokens == 8 and sampling.stop_token_ids == (3, 4)
    assert sampling.logit_bias == ((50256, -100.0), (7, 2.5))


def test_decode_json_body() -> None:
    assert decode_json_body(b'{"a": 1}') == {"a": 1}
    for raw in (b"", b"nul", b'"text"'):
        with pytest.raises(ApiError) as info:
            decode_json_body(raw)
        assert info.value.status == 400


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "a\ud800b"}, "prompt"),
    ({"prompt": "x", "stop": ["ok", "\udfff"]}, "stop"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "seed": 2**63}, "seed"),
])
def test_text_the_model_cannot_take_is_a_400_naming_the_field(body: dict[str, object], param: str) -> None:
    with pytest.raises(ApiError) as raised:
        parse_completion_request(body, request_id="r", model_ids=MODELS)
    assert raised.value.status == 400 and raised.value.param == param


def test_a_surrogate_in_a_chat_message_names_the_message() -> None:
    with pytest.raises(ApiError, match="unpaired surrogate .U\\+D83D.") as raised:
        parse_chat_request({"messages": [{"role": "user", "content": "hi \ud83d"}]}, request_id="r",
                           model_ids=MODELS)
    assert raised.value.param == "messages[0].content"


@pytest.mark.parametrize("raw", [b"[" * 100_000 + b"]" * 100_000, b'{"n": ' + b"9" * 5000 + b"}"])
def test_json_python_cannot_decode_is_a_400(raw: bytes) -> None:
    with pytest.raises(ApiError, match="not valid JSON") as raised:
        decode_json_body(raw)
    assert raised.value.status == 400


@pytest.mark.parametrize("parse", [parse_completion_request, parse_chat_request])
def test_priority_is_an_int32_lower_first_and_never_set_to_batch_by_a_client(parse: object) -> None:
    body = minimal_body(parse)
    assert parse({**body, "priority": -7}, request_id="r", model_ids=MODELS).priority == -7  # type: ignore[operator]
    with pytest.raises(ApiError) as refused:
        parse({**body, "is_batch": True}, request_id="r", model_ids=MODELS)  # type: ignore[operator]
    assert refused.value.param == "is_batch"
    for bad in (1.5, "high", True, 2**31):
        with pytest.raises(ApiError) as error:
            parse({**body, "priority": bad}, request_id="r", model_ids=MODELS)  # type: ignore[operator]
        assert error.value.status == 400 and error.value.param == "priority"


def test_chat_template_kwargs_are_variables_the_server_does_not_set() -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"enable_thinking": False, "b": 1}}
    assert parse_chat_request(body, request_id="r", model_ids=MODELS).template_kwargs == (("b", 1),
                                                                                        ("enable_thinking", False))
    for bad, param in (({"messages": []}, "chat_template_kwargs.messages"), ([1], "chat_template_kwargs"),
                       ({"not a name": 1}, "chat_template_kwargs.not a name")):
        with pytest.raises(ApiError) as raised:
            parse_chat_request({**body, "chat_template_kwargs": bad}, request_id="r", model_ids=MODELS)
        assert raised.value.param == param
