"""Predictors: Eq. 1 defaults, least-squares fits, transfer and queue time."""

import pytest

from mooncaked.sched.predictors import (
    DecodeStepPredictor,
    PrefillTimePredictor,
    TransferTimePredictor,
    least_squares,
    queue_time_s,
)
from mooncaked.sched.types import PrefillInstanceView


def test_prefill_default_follows_equation_1():
    predictor = PrefillTimePredictor.from_model(num_layers=80, hidden_size=8192, gpu_flops=8 * 312e12, mfu=1.0)
    n = 8192
    flops = 80 * (4 * n * n * 8192 + 22 * n * 8192**2)
    assert predictor.predict(n, 0) == pytest.approx(flops / (8 * 312e12), rel=1e-9)
    # Reusing p tokens saves l(a p^2 d + b p d^2) FLOPs (section 2.2).
    p = 4096
    saved = 80 * (4 * p * p * 8192 + 22 * p * 8192**2)
    assert predictor.predict(n, p) == pytest.approx((flops - saved) / (8 * 312e12), rel=1e-9)


def test_prefill_fit_recovers_a_polynomial():
    true = PrefillTimePredictor((0.05, 0.1, -0.08, 0.002, 0.0005, -0.001))
    samples = [(n, p, true.predict(n, p)) for n in range(1000, 33000, 4000) for p in range(0, n, 3000)]
    fitted = PrefillTimePredictor.fit(samples)
    for n, p, seconds in samples:
        assert fitted.predict(n, p) == pytest.approx(seconds, rel=1e-6, abs=1e-9)
    with pytest.raises(ValueError, match="at least 6"):
        PrefillTimePredictor.fit(samples[:3])


def test_decode_fit_and_default():
    true = DecodeStepPredictor((0.01, 0.0005, 0.002))
    samples = [(b, t, true.predict(b, t)) for b in (1, 8, 32, 64) for t in (1000, 50_000, 400_000)]
    fitted = DecodeStepPredictor.fit(samples)
    assert fitted.predict(16, 200_000) == pytest.approx(true.predict(16, 200_000), rel=1e-6)
    default = DecodeStepPredictor.from_model(weight_bytes=1e9, kv_bytes_per_token=1e3, hbm_bandwidth=1e12,
                                             bandwidth_utilisation=1.0)
    assert default.predict(1, 1_000_000) == pytest.approx(1e-3 + 1e-3)
    assert default.predict(0, 0) == 0.0


def test_least_squares_rejects_degenerate_input():
    with pytest.raises(ValueError):
        least_squares([], [])


def test_transfer_and_queue_time():
    transfer = TransferTimePredictor(bytes_per_block=100, bandwidth=1000.0, latency_s=0.5)
    assert transfer.predict(0) == 0.0
    assert transfer.predict(20) == pytest.approx(2.5)
    view = PrefillInstanceView("p", "s", busy_until=12.0, queued_prefill_s=3.0)
    assert queue_time_s(view, now=10.0) == pytest.approx(5.0)
    assert queue_time_s(view, now=20.0) == pytest.approx(3.0)
