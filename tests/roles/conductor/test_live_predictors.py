"""LivePredictors: refits from measured samples every min_samples; only the refitted predictor changes."""

from __future__ import annotations

import pytest

from mooncaked.roles.conductor.live_predictors import LivePredictors
from mooncaked.sched.predictors import DecodeStepPredictor, Predictors, PrefillTimePredictor, TransferTimePredictor


def defaults() -> Predictors:
    return Predictors(PrefillTimePredictor((1.0, 0.0, 0.0, 0.0, 0.0, 0.0)), DecodeStepPredictor((0.5, 0.0, 0.0)),
                      TransferTimePredictor(4096, 1e9))


def test_prefill_refits_every_min_samples_from_the_measurements() -> None:
    live = LivePredictors(defaults(), min_samples=8)
    samples = [(n, p, 0.002 * (n - p)) for n in (100, 200, 400, 800) for p in (0, n // 2)]  # 2 ms per new token
    for n, p, seconds in samples[:7]:
        live.add_prefill(n, p, seconds)
    assert live.num_refits == 0 and live.current.prefill.predict(300, 0) == 1.0  # the default until 8 samples
    live.add_prefill(*samples[7])
    assert live.num_refits == 1 and live.num_samples() == {"prefill": 8, "decode": 0}
    assert live.current.prefill.predict(300, 100) == pytest.approx(0.4, rel=1e-3)
    assert live.current.decode == defaults().decode and live.current.transfer == defaults().transfer


def test_decode_skips_repeated_idle_polls() -> None:
    live = LivePredictors(defaults(), min_samples=4)
    for _ in range(10):
        live.add_decode(2, 100, 0.01)  # one step's numbers, repeated by polls while idle
    assert live.num_samples()["decode"] == 1 and live.num_refits == 0
    for batch in (2, 4, 8):
        live.add_decode(batch, 1000 * batch, 0.01 + 0.001 * batch)
    assert live.num_refits == 1 and live.current.decode.predict(6, 6000) == pytest.approx(0.016, rel=1e-3)
