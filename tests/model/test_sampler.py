"""Sampling behaviour: greedy, seeds, and the distribution a draw takes (temperature, min-p, top-k, top-p)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mooncaked.model.sampler import Sampler, candidate_probs, make_generator
from mooncaked.model.sampling_params import SamplingParams
from tests.model.sampling_reference import reference_probs


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


@st.composite
def distributions(draw: st.DrawFn) -> tuple[list[float], SamplingParams]:
    vocab = draw(st.integers(2, 40))
    scores = [x / 100 for x in draw(st.lists(st.integers(-1500, 1500), min_size=vocab, max_size=vocab, unique=True))]
    params = SamplingParams(temperature=draw(st.floats(0.05, 2.0)), min_p=draw(st.floats(0.0, 1.0) | st.just(0.0)),
                            top_k=draw(st.integers(0, vocab)), top_p=draw(st.floats(0.01, 1.0) | st.just(1.0)))
    return scores, params


@settings(max_examples=150, deadline=None)
@given(distributions())
def test_candidate_distribution_equals_temperature_min_p_top_k_top_p(case: tuple[list[float], SamplingParams]) -> None:
    scores, params = case
    kwargs = {"temperature": params.temperature, "min_p": params.min_p, "top_k": params.top_k, "top_p": params.top_p}
    expected = reference_probs(scores, **kwargs)
    for nudge in (-1e-4, 1e-4):  # skip cases on a threshold's edge, where fp32 and fp64 may keep different sets
        nudged = reference_probs(scores, **{**kwargs, "min_p": min(max(params.min_p + nudge, 0.0), 1.0),
                                            "top_p": min(max(params.top_p + nudge, 1e-6), 1.0)})
        assume([p > 0 for p in nudged] == [p > 0 for p in expected])
    got = candidate_probs(torch.tensor(scores), params)
    got = got / got.sum()
    assert got.tolist() == pytest.approx(expected, abs=1e-5)


def test_min_p_keeps_tokens_at_least_min_p_times_the_top_probability() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    sampler = Sampler(seed=0)
    drawn = {sampler.sample(logits, [SamplingParams(min_p=0.35)]).token_ids[0] for _ in range(200)}
    assert drawn == {0, 1}  # 0.15 < 0.35 * 0.5
