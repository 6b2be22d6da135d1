"""PerformanceModel: honest per-request samples, the paper-form fit with non-negative terms, refit cadence."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncaked.sched.perf_model import PerformanceModel, attribute_batch_time, prefill_flops
from mooncaked.sched.predictors import DecodeStepPredictor, PrefillTimePredictor

prompts = st.lists(st.integers(1, 8192).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n))),
                   min_size=1, max_size=16)


@settings(max_examples=200, deadline=None)
@given(prompts, st.floats(0.0, 1e4, allow_nan=False), st.integers(1, 16384))
def test_a_batch_time_splits_into_per_request_shares_that_sum_to_it(batch: list[tuple[int, int]], batch_s: float,
                                                                     hidden_size: int) -> None:
    shares = attribute_batch_time(batch_s, batch, hidden_size)
    assert len(shares) == len(batch) and all(s >= 0 for s in shares)
    assert math.isclose(sum(shares), batch_s, rel_tol=1e-9, abs_tol=1e-9)


def test_shares_follow_compute_a_long_prompt_pays_more_and_a_cached_one_less() -> None:
    short, long, cached = (100, 0), (1000, 0), (1000, 900)
    shares = attribute_batch_time(1.0, [short, long, cached], hidden_size=576)
    assert shares[1] > shares[2] > 0 and shares[1] > shares[0]
    assert shares[1] / shares[0] == pytest.approx(prefill_flops(1000, 0, 576) / prefill_flops(100, 0, 576))
    assert attribute_batch_time(2.0, [(5, 5), (7, 7)], hidden_size=64) == [1.0, 1.0]  # nothing new: even split


def test_the_paper_form_fit_recovers_new_token_and_attention_costs() -> None:
    true = PrefillTimePredictor((0.05, 0.8, -0.8, 0.3, 0.0, -0.3))  # seconds per 1k new tokens, per 1M n^2-p^2
    samples = [(n, p, true.predict(n, p)) for n in (64, 256, 1024, 4096) for p in (0, n // 2)]
    fitted = PrefillTimePredictor.fit_paper_form(samples)
    for n, p in [(2000, 0), (8000, 4000), (300, 200)]:
        assert fitted.predict(n, p) == pytest.approx(true.predict(n, p), rel=1e-6)


def test_terms_that_fit_negative_are_dropped_not_kept() -> None:
    # noise makes the attention term fit negative on these short prompts: it is dropped, the time stays linear
    samples = [(64, 0, 0.110), (128, 0, 0.205), (256, 0, 0.390), (256, 128, 0.212), (128, 64, 0.098)]
    fitted = PrefillTimePredictor.fit_paper_form(samples)
    assert fitted.coefficients[3] >= 0 and fitted.coefficients[1] > 0
    assert fitted.predict(4096, 0) > fitted.predict(2048, 0) > 0
    step = DecodeStepPredictor.fit([(1, 100, 0.05), (2, 200, 0.049), (4, 400, 0.051)], relative=True)
    assert step.coefficients[1] >= 0 and step.coefficients[2] >= 0


def test_profile_samples_stay_and_live_samples_refit_every_few() -> None:
    model = PerformanceModel(refit_every=4, max_live_samples=8)
    for n in (64, 256, 1024):
        model.add_profile_prefill(n, 0, 0.001 * n)
        model.add_profile_prefill(n, n // 2, 0.0005 * n)
    model.refit()
    assert model.prefill is not None and model.prefill.predict(2048, 0) == pytest.approx(2.048, rel=1e-6)
    before = model.num_refits
    for _ in range(3):
        model.add_prefill(512, 0, 1.024)  # the live machine is twice as slow as the profile said
    assert model.num_refits == before
    model.add_prefill(512, 0, 1.024)
    assert model.num_refits == before + 1 and model.prefill.predict(512, 0) > 0.512
    for bad in (0.0, -1.0, math.nan, math.inf):
        model.add_prefill(512, 0, bad)
    assert model.num_samples()["prefill_live"] == 4
    assert model.coefficients().decode == () and len(model.coefficients().prefill) == 6


def test_a_scale_follows_the_instance_between_refits_and_a_refit_resets_it() -> None:
    model = PerformanceModel(refit_every=100)
    for n in (64, 256, 1024):
        model.add_profile_prefill(n, 0, 0.001 * n)
    model.add_profile_decode(1, 100, 0.05)
    model.add_profile_decode(4, 400, 0.06)
    model.add_profile_decode(8, 800, 0.07)
    model.refit()
    assert model.prefill is not None and model.prefill.predict(1000, 0) == pytest.approx(1.0, rel=1e-6)
    for _ in range(20):  # the machine got twice as slow: batches take twice their prediction
        model.observe_prefill_batch(predicted_s=0.5, actual_s=1.0)
    assert model.prefill.predict(1000, 0) == pytest.approx(2.0, rel=1e-3)
    assert model.coefficients().prefill[1] == pytest.approx(2 * model.prefill_fit.coefficients[1], rel=1e-3)
    assert model.decode is not None
    step_s = model.decode.predict(4, 400)
    for _ in range(20):  # inline prefills between steps: tokens come 50% later than the steps alone
        model.observe_decode_interval(4, 400, 1.5 * step_s)
    assert model.decode.predict(4, 400) == pytest.approx(1.5 * step_s, rel=1e-3)
    model.refit_prefill()
    assert model.prefill.predict(1000, 0) == pytest.approx(1.0, rel=1e-6)
    model.observe_prefill_batch(predicted_s=0.0, actual_s=1.0)  # nothing predicted: no ratio
    model.observe_decode_interval(4, 400, math.nan)
    assert model.prefill_scale.count == 0
