"""P/D ratio controller: trimmed means, direction, bounded steps, floors."""

import pytest

from mooncaked.sched.pd_ratio import PdRatioConfig, decide, imbalance_factor, trimmed_mean


def test_trimmed_mean_discards_outliers():
    samples = [0.5] * 8 + [100.0, -100.0]
    assert trimmed_mean(samples, 0.1) == pytest.approx(0.5)
    assert trimmed_mean([], 0.1) == 0.0


def test_imbalance_factor():
    assert imbalance_factor([1.0] * 10, [3.0] * 10, 0.1) == pytest.approx(2.0)


def test_moves_toward_hotter_side_in_bounded_steps():
    config = PdRatioConfig(max_step=2)
    decision = decide([0.2] * 10, [0.8] * 10, num_prefill=8, num_decode=8, config=config)
    assert decision.reason == "move_prefill_to_decode"
    assert (decision.delta_prefill, decision.delta_decode) == (-2, 2)  # |log 1.5| wants 5, capped at 2
    decision = decide([0.8] * 10, [0.2] * 10, 8, 8, PdRatioConfig(max_step=1))
    assert (decision.delta_prefill, decision.delta_decode) == (1, -1)


def test_holds_within_tolerance():
    decision = decide([0.5] * 10, [0.55] * 10, 8, 8, PdRatioConfig())
    assert decision.reason == "hold" and decision.delta_prefill == decision.delta_decode == 0


def test_scale_out_hotter_side_and_in_colder_side():
    config = PdRatioConfig(max_step=3, max_instances=17)
    out = decide([0.5] * 10, [1.5] * 10, 8, 8, config)
    assert out.reason == "scale_out_decode" and (out.delta_prefill, out.delta_decode) == (0, 1)  # cluster max
    ebb = decide([0.05] * 10, [0.2] * 10, 8, 8, PdRatioConfig(max_step=3))
    assert ebb.reason == "scale_in_prefill" and ebb.delta_prefill == -2 and ebb.delta_decode == 0


def test_respects_minimum_per_side():
    decision = decide([0.1] * 10, [0.8] * 10, num_prefill=1, num_decode=8, config=PdRatioConfig(min_per_side=1))
    assert decision.delta_prefill == 0 and decision.delta_decode == 0


def test_repeated_steps_converge_without_overshoot():
    # Fixed work per pool (2.0 instance-loads each) spread over the pool's instances.
    num_prefill, num_decode = 12, 4
    config = PdRatioConfig(max_step=1, tolerance=0.1, scale_in_load=0.1)  # the tide is steady: moves only
    deltas = []
    for _ in range(20):
        prefill_load, decode_load = 2.0 / num_prefill, 2.0 / num_decode
        decision = decide([prefill_load] * 10, [decode_load] * 10, num_prefill, num_decode, config)
        assert abs(decision.delta_prefill) <= 1 and decision.delta_prefill == -decision.delta_decode
        deltas.append(decision.delta_prefill)
        num_prefill += decision.delta_prefill
        num_decode += decision.delta_decode
    assert all(d <= 0 for d in deltas)  # only ever towards decode: no oscillation
    final = imbalance_factor([2.0 / num_prefill], [2.0 / num_decode], 0.0)
    assert 1 / 1.1 <= final <= 1.1 and (num_prefill, num_decode) == (9, 7)
