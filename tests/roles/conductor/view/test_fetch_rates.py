"""FetchRates: a moving average per (prefill instance, source store), dropped with either end."""

from hypothesis import given
from hypothesis import strategies as st

from mooncaked.roles.conductor.view.fetch_rates import SMOOTHING, FetchRates


def test_the_average_follows_a_link_that_slows_down() -> None:
    rates = FetchRates()
    rates.observe("p4", "s2", 1000, 1.0)
    assert rates.for_instance("p4") == (("s2", 1000.0),)
    rates.observe("p4", "s2", 100, 1.0)  # a tenth of the rate: the average moves halfway
    assert rates.for_instance("p4") == (("s2", SMOOTHING * 100 + (1 - SMOOTHING) * 1000),)
    rates.observe("p5", "s2", 10, 1.0)
    rates.forget("s2")
    assert rates.for_instance("p4") == () and rates.for_instance("p5") == ()


@given(st.integers(-10, 10**9), st.floats(allow_nan=False, allow_infinity=False, max_value=1e6))
def test_nothing_measured_from_an_empty_or_timeless_fetch(num_bytes: int, seconds: float) -> None:
    rates = FetchRates()
    rates.observe("p4", "s2", num_bytes, seconds)
    measured = rates.for_instance("p4")
    assert measured == (() if num_bytes <= 0 or seconds <= 0 else (("s2", num_bytes / seconds),))
