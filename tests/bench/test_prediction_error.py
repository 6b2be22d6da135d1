"""Prediction error summaries: MAPE and bias over served requests, and over the first ones in arrival order."""

from __future__ import annotations

import pytest

from mooncaked.bench.prediction_error import prediction_summary
from mooncaked.bench.stats import RequestResult


def served(index: int, predicted_ttft_s: float, ttft_s: float) -> RequestResult:
    return RequestResult(is_success=True, status=200, num_output_tokens=3, ttft_s=ttft_s, e2el_s=ttft_s + 0.2,
                         index=index, predicted_ttft_s=predicted_ttft_s, predicted_tbt_s=0.1)


def test_mape_and_bias_overall_and_for_the_first_in_arrival_order() -> None:
    # completion order differs from arrival order: the first two by index are the exact ones
    results = [served(5, 2.0, 1.0), served(0, 1.0, 1.0), served(1, 0.5, 0.5),
               RequestResult(is_success=False, status=429, index=2)]
    summary = prediction_summary(results, num_first=2)
    assert summary["num_predicted"] == 3
    assert summary["ttft_prediction_mape"] == pytest.approx(1 / 3)
    assert summary["ttft_prediction_bias"] == pytest.approx(1.0)
    assert summary["ttft_prediction_mape_first2"] == pytest.approx(0.0)
    assert summary["tbt_prediction_mape"] == pytest.approx(0.0)  # tpot = 0.2 s / 2 gaps
    assert [p["index"] for p in summary["predictions"]] == [0, 1, 5]


def test_nothing_predicted_gives_none_not_an_error() -> None:
    summary = prediction_summary([RequestResult(is_success=True, status=200, ttft_s=1.0)])
    assert summary["num_predicted"] == 0 and summary["ttft_prediction_mape"] is None
