"""Each sampling control against its definition (tests/model/sampling_reference.py) on generated logits and
token histories: logit_bias, min_tokens, repetition, frequency and presence penalties, and greedy choice over them."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncaked.model.logits_processing import TokenHistory, adjust_logits
from mooncaked.model.sampler import Sampler
from mooncaked.model.sampling_params import SamplingParams
from tests.model.sampling_reference import reference_adjust

EOS = (1,)


@st.composite
def cases(draw: st.DrawFn) -> tuple[list[float], SamplingParams, list[int], list[int]]:
    """Distinct logits (ties would make argmax ambiguous), a prompt, an output, and the controls."""
    vocab = draw(st.integers(2, 40))
    logits = [x / 100 for x in draw(st.lists(st.integers(-1500, 1500), min_size=vocab, max_size=vocab, unique=True))]
    tokens = st.integers(0, vocab - 1)
    prompt = draw(st.lists(tokens, max_size=30))
    output = draw(st.lists(tokens, max_size=30))
    penalty = st.floats(-2.0, 2.0, allow_nan=False) | st.just(0.0)
    params = SamplingParams(
        temperature=0.0, presence_penalty=draw(penalty), frequency_penalty=draw(penalty),
        repetition_penalty=draw(st.floats(0.05, 2.0) | st.just(1.0)),
        logit_bias=draw(st.dictionaries(tokens, st.floats(-100.0, 100.0), max_size=5)),
        min_tokens=draw(st.integers(0, 8)), stop_token_ids=draw(st.lists(tokens, max_size=3, unique=True)),
        ignore_eos=draw(st.booleans()))
    return logits, params, prompt, output


def _reference(logits: list[float], params: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    stop_ids = list(params.stop_token_ids) + ([] if params.ignore_eos else [t for t in EOS if t < len(logits)])
    return reference_adjust(logits, prompt=prompt, output=output, logit_bias=params.logit_bias,
                            min_tokens=params.min_tokens, stop_ids=stop_ids,
                            repetition_penalty=params.repetition_penalty,
                            frequency_penalty=params.frequency_penalty, presence_penalty=params.presence_penalty)


@settings(max_examples=150, deadline=None)
@given(cases())
def test_adjusted_logits_equal_the_definitions(case: tuple[list[float], SamplingParams, list[int], list[int]]) -> None:
    logits, params, prompt, output = case
    vocab = len(logits)
    sampler = Sampler(seed=0, eos_token_ids=[t for t in EOS if t < vocab])
    history = TokenHistory(prompt + output, len(prompt))
    got = sampler.adjusted(torch.tensor([logits]), [params], [history])[0].tolist()
    expected = _reference(logits, params, prompt, output)
    for g, e in zip(got, expected):
        assert (g == e == float("-inf")) or g == pytest.approx(e, rel=1e-5, abs=1e-4)
    finite = [e for e in expected if e != float("-inf")]
    top = max(expected)
    if finite and sum(1 for e in expected if abs(e - top) < 1e-3) == 1:  # one clear winner: greedy takes it
        assert sampler.sample(torch.tensor([logits]), [params], None, [history]).token_ids == [expected.index(top)]


@settings(max_examples=60, deadline=None)
@given(cases(), st.integers(0, 3))
def test_each_control_alone_equals_its_definition(case: tuple[list[float], SamplingParams, list[int], list[int]],
                                                  which: int) -> None:
    """One control at a time, so a wrong one cannot hide behind another's effect."""
    logits, params, prompt, output = case
    alone: dict[str, Any] = [
        {"presence_penalty": params.presence_penalty}, {"frequency_penalty": params.frequency_penalty},
        {"repetition_penalty": params.repetition_penalty},
        {"logit_bias": params.logit_bias, "min_tokens": params.min_tokens, "stop_token_ids": params.stop_token_ids},
    ][which]
    single = SamplingParams(temperature=0.0, ignore_eos=True, **alone)
    got = adjust_logits(torch.tensor(logits), single, TokenHistory(prompt + output, len(prompt)),
                        single.stop_token_ids).tolist()
    expected = _reference(logits, single, prompt, output)
    assert all((g == e == float("-inf")) or g == pytest.approx(e, rel=1e-5, abs=1e-4) for g, e in zip(got, expected))


def test_penalties_count_output_tokens_only_and_repetition_reads_the_prompt() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    history = TokenHistory([0, 1, 2, 2], num_prompt_tokens=2)  # prompt 0, 1; output 2, 2
    freq = adjust_logits(logits, SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), history, ())
    assert freq.tolist() == [2.0, -2.0, 1.0 - 2 * 0.5 - 0.25, 0.5]
    rep = adjust_logits(logits, SamplingParams(repetition_penalty=2.0), history, ())
    assert rep.tolist() == [1.0, -4.0, 0.5, 0.5]


def test_min_tokens_holds_eos_and_stop_tokens_back_until_reached() -> None:
    sampler = Sampler(eos_token_ids=[0])
    logits = torch.tensor([[5.0, 4.0, 1.0]])
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1])
    short, enough = TokenHistory([2, 2], 1), TokenHistory([2, 2, 2], 1)
    assert sampler.sample(logits, [params], None, [short]).token_ids == [2]
    assert sampler.sample(logits, [params], None, [enough]).token_ids == [0]
    ignoring = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1], ignore_eos=True)
    assert sampler.sample(logits, [ignoring], None, [short]).token_ids == [0]  # EOS is no stop token here


def test_controls_that_read_history_refuse_to_run_without_it() -> None:
    with pytest.raises(ValueError, match="history"):
        Sampler().sample(torch.zeros(1, 4), [SamplingParams(presence_penalty=1.0)])


def test_logprobs_come_from_the_unadjusted_distribution() -> None:
    logits = torch.tensor([[3.0, 1.0, 0.0]])
    params = SamplingParams(temperature=0.0, logit_bias={2: 50.0}, logprobs=1)
    out = Sampler().sample(logits, [params])
    assert out.token_ids == [2]
    assert out.logprobs[0] is not None
    assert out.logprobs[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[2]))
    assert math.isfinite(out.logprobs[0].top[0][1]) and out.logprobs[0].top[0][0] == 0


@settings(max_examples=60, deadline=None)
@given(cases(), st.data())
def test_a_grammar_mask_leaves_only_its_tokens_after_the_controls(
        case: tuple[list[float], SamplingParams, list[int], list[int]], data: st.DataObject) -> None:
    logits, params, prompt, output = case
    allowed = data.draw(st.lists(st.booleans(), min_size=len(logits), max_size=len(logits)).filter(any))
    sampler = Sampler(seed=0, eos_token_ids=list(EOS))
    history = TokenHistory(prompt + output, len(prompt))
    mask = torch.zeros(len(logits)).masked_fill(~torch.tensor(allowed), float("-inf"))
    got = sampler.adjusted(torch.tensor([logits]), [params], [history], [mask])[0].tolist()
    controlled = _reference(logits, params, prompt, output)
    if not any(a and c != float("-inf") for a, c in zip(allowed, controlled)):
        controlled = logits  # the controls left nothing the grammar allows: the grammar wins
    expected = [c if a else float("-inf") for a, c in zip(allowed, controlled)]
    assert all((g == e == float("-inf")) or g == pytest.approx(e, rel=1e-5, abs=1e-4) for g, e in zip(got, expected))
    token = sampler.sample(torch.tensor([logits]), [SamplingParams(temperature=1.0, **{
        k: getattr(params, k) for k in ("presence_penalty", "frequency_penalty", "repetition_penalty")})],
        None, [history], [mask]).token_ids[0]
    assert allowed[token]
