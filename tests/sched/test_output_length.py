"""OutputLengthPredictor: conservative until it learns, a quantile by key, conditional on what was generated."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncaked.sched.output_length import OutputLengthPredictor


def test_it_answers_max_tokens_until_it_has_learned() -> None:
    predictor = OutputLengthPredictor(min_samples=4)
    assert predictor.predict(api_key="a", max_tokens=200, num_prompt_tokens=100) == 200
    for length in (10, 20, 30):
        predictor.observe(api_key="a", max_tokens=200, num_prompt_tokens=100, num_output_tokens=length)
    assert predictor.predict(api_key="a", max_tokens=200, num_prompt_tokens=100) == 200  # 3 < min_samples


def test_the_quantile_of_the_most_specific_level_with_enough_samples() -> None:
    predictor = OutputLengthPredictor(quantile=0.5, min_samples=4)
    for length in (10, 20, 30, 40, 50):
        predictor.observe(api_key="chat", max_tokens=256, num_prompt_tokens=300, num_output_tokens=length)
    for length in (200, 210, 220, 230):
        predictor.observe(api_key="summaries", max_tokens=256, num_prompt_tokens=300, num_output_tokens=length)
    assert predictor.predict(api_key="chat", max_tokens=256, num_prompt_tokens=300) == 30
    assert predictor.predict(api_key="summaries", max_tokens=256, num_prompt_tokens=300) == 210
    # an unknown key falls back to its max_tokens and prompt length bucket (all nine lengths)
    assert predictor.predict(api_key="new", max_tokens=256, num_prompt_tokens=300) == 50
    # learned as fractions of max_tokens: the cluster-wide level answers for another max_tokens
    assert predictor.predict(api_key="new", max_tokens=2, num_prompt_tokens=5) == 1


def test_a_request_that_already_generated_more_is_predicted_from_the_longer_ones() -> None:
    predictor = OutputLengthPredictor(quantile=0.5, min_samples=2)
    for length in (10, 10, 10, 10, 100, 120):
        predictor.observe(api_key="", max_tokens=128, num_prompt_tokens=64, num_output_tokens=length)
    assert predictor.predict(api_key="", max_tokens=128, num_prompt_tokens=64) == 10
    assert predictor.predict(api_key="", max_tokens=128, num_prompt_tokens=64, num_generated=50) == 100
    assert predictor.predict(api_key="", max_tokens=128, num_prompt_tokens=64, num_generated=125) == 128


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.text(max_size=4), st.integers(-5, 5000), st.integers(-5, 10**6), st.integers(-5, 6000)),
                max_size=60),
       st.text(max_size=4), st.integers(1, 5000), st.integers(0, 10**6), st.integers(0, 6000))
def test_predictions_stay_within_what_is_possible(observed: list[tuple[str, int, int, int]], key: str,
                                                  max_tokens: int, num_prompt: int, num_generated: int) -> None:
    predictor = OutputLengthPredictor(min_samples=1, max_keys=16)
    for api_key, mt, prompt_len, out in observed:
        predictor.observe(api_key=api_key, max_tokens=mt, num_prompt_tokens=prompt_len, num_output_tokens=out)
    value = predictor.predict(api_key=key, max_tokens=max_tokens, num_prompt_tokens=num_prompt,
                              num_generated=num_generated)
    assert min(num_generated + 1, max_tokens) <= value <= max_tokens
    assert len(predictor._fractions) <= 16


def test_bad_settings_are_refused() -> None:
    for kwargs in ({"quantile": 0.0}, {"quantile": 1.5}, {"window": 0}, {"max_keys": 2}):
        with pytest.raises(ValueError):
            OutputLengthPredictor(**kwargs)  # type: ignore[arg-type]
