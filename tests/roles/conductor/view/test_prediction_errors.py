"""PredictionErrors: relative errors into histograms, a ring of recent records, the first requests kept apart."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from mooncaked.roles.conductor.view.prediction_errors import PredictionErrors, PredictionRecord, summary
from mooncaked.runtime.metrics import PredictionMetrics


def test_records_summaries_and_histograms() -> None:
    registry = CollectorRegistry()
    errors = PredictionErrors(PredictionMetrics(registry), capacity=3, num_first=2)
    for i, (predicted, actual) in enumerate([(1.0, 1.0), (3.0, 2.0), (1.0, 2.0), (2.0, 2.0)]):
        errors.record(PredictionRecord(f"r{i}", predicted, actual, 0.1, 0.2 if i else None))
    errors.record(PredictionRecord("bad", 1.0, 0.0, 0.1, 0.1))  # no measured TTFT: not scored
    described = errors.describe()
    assert [r["request_id"] for r in described["recent"]] == ["r1", "r2", "r3"]
    assert described["ttft"]["first"] == {"count": 2, "mape": pytest.approx(0.25), "bias": pytest.approx(1.25)}
    assert described["ttft"]["recent"]["mape"] == pytest.approx((0.5 + 0.5 + 0.0) / 3)
    assert described["tbt"]["first"]["count"] == 1  # r0 had one token: no TBT
    assert registry.get_sample_value("mooncaked_ttft_prediction_relative_error_count") == 4
    assert registry.get_sample_value("mooncaked_tbt_prediction_relative_error_count") == 3
    assert summary([]) == {"count": 0, "mape": None, "bias": None}
