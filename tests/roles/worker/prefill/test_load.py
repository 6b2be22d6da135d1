"""PrefillLoad: held work in predicted seconds, and a running batch past its prediction slowing the rest down."""

import pytest

from mooncaked.roles.worker.prefill.load import PrefillLoad
from mooncaked.sched.perf_model import PerformanceModel


def fitted_load() -> PrefillLoad:
    """A model where a prompt of n new tokens (no prefix) takes about n ms."""
    perf = PerformanceModel()
    for num_tokens in (64, 128, 256, 512, 1024, 2048):
        perf.add_profile_prefill(num_tokens, 0, num_tokens / 1000)
        perf.add_profile_prefill(num_tokens, num_tokens, 2 * num_tokens / 1000)
    perf.refit()
    return PrefillLoad(perf, hidden_size=64)


def test_held_work_is_the_rest_of_the_batch_and_the_queue() -> None:
    load = fitted_load()
    one_s = load.predict(1000, 0)
    assert one_s > 0.1
    load.batch_started([(1000, 0)], now=10.0)
    assert load.slowdown(10.5) == 1.0
    assert load.pending_work_s([(1000, 0)], now=10.5) == pytest.approx(one_s - 0.5 + one_s)


def test_a_batch_past_its_prediction_slows_the_queue_and_the_reported_model_down() -> None:
    load = fitted_load()
    one_s = load.predict(1000, 0)
    load.batch_started([(1000, 0)], now=10.0)
    late = 10.0 + 3 * one_s
    assert load.slowdown(late) == pytest.approx(3.0)
    assert load.pending_work_s([(1000, 0), (1000, 0)], now=late) == pytest.approx(3 * 2 * one_s)
    reported = load.coefficients(late).prefill
    assert reported == pytest.approx(tuple(3 * c for c in load.perf.coefficients().prefill))
    load.batch_finished([(1000, 0)], elapsed_s=3 * one_s)
    assert load.slowdown(late + 1) == 1.0  # idle: the scale has learnt it instead
    assert load.predict(1000, 0) == pytest.approx(3 * one_s, rel=0.05)


def test_a_batch_that_fetched_a_prefix_teaches_the_model_nothing() -> None:
    # Its forward waited for another host's link layer by layer: 10x the compute. Learnt, it would make every
    # prompt, recomputed ones too, look 10x slower to the scheduler.
    load = fitted_load()
    one_s = load.predict(1000, 0)
    for _ in range(40):
        load.batch_started([(1000, 0)], now=10.0)
        load.batch_finished([(1000, 0)], elapsed_s=10 * one_s, is_sample=False)
    assert load.predict(1000, 0) == pytest.approx(one_s)
    assert load.slowdown(100.0) == 1.0 and load.pending_work_s([], now=100.0) == 0.0
