"""LivePredictors: every instance's reported model, the newest one as the default, the built-in model until then."""

from __future__ import annotations

from mooncaked.roles.conductor.view.predictors import LivePredictors
from mooncaked.sched.predictors import DecodeStepPredictor, Predictors, PrefillTimePredictor, TransferTimePredictor


def defaults() -> Predictors:
    return Predictors(PrefillTimePredictor((1.0, 0.0, 0.0, 0.0, 0.0, 0.0)), DecodeStepPredictor((0.5, 0.0, 0.0)),
                      TransferTimePredictor(4096, 1e9))


def test_the_built_in_model_serves_until_an_instance_reports() -> None:
    live = LivePredictors(defaults())
    assert live.prefill_for("p0").predict(300, 0) == 1.0 and live.decode_for("d0").predict(1, 10) == 0.5
    live.report("p0", [], [])  # a LOAD reply from an instance whose model is not fitted
    assert live.current == defaults() and live.num_reports == 0


def test_each_instance_predicts_with_its_own_model_and_the_newest_is_the_default() -> None:
    live = LivePredictors(defaults())
    live.report("p0", [0.0, 2.0, -2.0, 0.0, 0.0, 0.0], [])  # 2 ms per new token
    live.report("p1", [0.0, 4.0, -4.0, 0.0, 0.0, 0.0], [])
    live.report("d0", [], [0.01, 0.001, 0.0])
    assert abs(live.prefill_for("p0").predict(1000, 0) - 2.0) < 1e-9
    assert abs(live.prefill_for("p1").predict(1000, 500) - 2.0) < 1e-9
    assert abs(live.prefill_for("p9").predict(1000, 0) - 4.0) < 1e-9  # unknown: the newest reported
    assert abs(live.decode_for("d0").predict(10, 0) - 0.02) < 1e-9
    assert live.current.transfer == defaults().transfer and live.num_reports == 3
    live.report("p0", [0.0, 2.0, -2.0, 0.0, 0.0, 0.0], [])  # an unchanged model is no new report
    assert live.num_reports == 3
    assert live.has_model("p0") == {"prefill": True, "decode": False}


def test_malformed_coefficients_are_ignored_and_a_gone_instance_is_forgotten() -> None:
    live = LivePredictors(defaults())
    live.report("p0", [1.0, 2.0], [1.0])
    assert live.has_model("p0") == {"prefill": False, "decode": False}
    live.report("p0", [0.0] * 6, [0.1, 0.0, 0.0])
    live.forget("p0")
    assert live.has_model("p0") == {"prefill": False, "decode": False}
