"""SamplingParams validation: every bad value names its parameter."""

from __future__ import annotations

import pytest

from mooncaked.model.sampling_params import SamplingParams


@pytest.mark.parametrize("kwargs, name", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_k": -2}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"seed": -1}, "seed"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop_token_ids": [-3]}, "stop_token_ids"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": float("inf")}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {3: 101.0}}, "logit_bias"),
    ({"logit_bias": [(-1, 1.0)]}, "logit_bias"),
    ({"logit_bias": [(3, 1.0), (3, 2.0)]}, "logit_bias"),
    ({"logit_bias": [5]}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"),
])
def test_invalid_parameters_name_the_parameter(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=f"^{name} "):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_stop_accepts_a_single_string_and_lists() -> None:
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[5]).stop_token_ids == (5,)
