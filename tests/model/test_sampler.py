"""Sampling parameters validation and sampling behaviour."""

from __future__ import annotations

import pytest
import torch

from mooncaked.model.sampler import Sampler, SamplingParams, make_generator


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
])
def test_invalid_parameters_name_the_parameter(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=f"^{name} "):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_stop_accepts_a_single_string_and_lists() -> None:
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[5]).stop_token_ids == (5,)


def test_greedy_is_argmax_and_logprobs_are_normalized() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 0.0]])
    out = Sampler(seed=0).sample(logits, [SamplingParams(temperature=0.0, logprobs=2),
                                          SamplingParams(temperature=0.0)])
    assert out.token_ids == [1, 0]
    first = out.logprobs[0]
    assert first is not None and out.logprobs[1] is None
    assert [t for t, _ in first.top] == [1, 3]
    assert first.logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[1]))


def test_seed_makes_sampling_reproducible_per_request() -> None:
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=1234)
    sampler = Sampler()

    def draw() -> list[int]:
        gen = make_generator(params)
        return [sampler.sample(logits, [params], [gen]).token_ids[0] for _ in range(20)]

    assert draw() == draw()


def test_top_k_and_top_p_restrict_the_candidates() -> None:
    logits = torch.tensor([[4.0, 3.9, 0.0, -1.0, -2.0]])
    sampler = Sampler(seed=0)
    top_k = {sampler.sample(logits, [SamplingParams(top_k=2)]).token_ids[0] for _ in range(50)}
    assert top_k <= {0, 1} and len(top_k) == 2
    top_p = {sampler.sample(logits, [SamplingParams(top_p=0.4)]).token_ids[0] for _ in range(30)}
    assert top_p == {0}


def test_params_count_must_match_rows() -> None:
    with pytest.raises(ValueError, match="sampling params"):
        Sampler().sample(torch.zeros(2, 4), [SamplingParams()])
