"""The switch planner: pd_ratio decisions carried out as switches, with hysteresis, confirmation and dwell."""

from __future__ import annotations

from hypothesis import given, strategies as st

from mooncaked.sched.pd_ratio import PdRatioConfig
from mooncaked.sched.pd_switch import SwitchCandidate, SwitchPlanner

RATIO = PdRatioConfig(tolerance=0.5, scale_out_load=0.9, scale_in_load=0.05, min_per_side=1)


def fleet(num_prefill: int, num_decode: int, switchable: bool = True) -> list[SwitchCandidate]:
    return ([SwitchCandidate(f"p{i}", "prefill", switchable, True, i / 10, None) for i in range(num_prefill)]
            + [SwitchCandidate(f"d{i}", "decode", switchable, True, i / 10, None) for i in range(num_decode)])


def run(planner: SwitchPlanner, candidates: list[SwitchCandidate], prefill: float, decode: float, now: float):
    planner.observe(prefill, decode)
    return planner.plan(candidates, now)


def test_a_hot_decode_pool_takes_the_least_loaded_prefill_after_confirmation() -> None:
    planner = SwitchPlanner(RATIO, window=4, num_confirm=3, dwell_s=5.0)
    candidates = fleet(2, 1)
    assert run(planner, candidates, 0.1, 2.0, 0.0) is None
    assert run(planner, candidates, 0.1, 2.0, 1.0) is None
    plan = run(planner, candidates, 0.1, 2.0, 2.0)
    assert plan is not None and (plan.name, plan.from_role, plan.to_role) == ("p0", "prefill", "decode")
    planner.switched(plan.name, 2.0)
    for now in (3.0, 4.0, 5.0, 6.0):  # dwell: nothing for 5 s after a switch, however hot
        assert run(planner, fleet(1, 2), 3.0, 0.1, now) is None
    assert run(planner, fleet(1, 2), 3.0, 0.1, 7.5) is not None


def test_hysteresis_band_and_minimum_per_side_hold() -> None:
    planner = SwitchPlanner(RATIO, window=4, num_confirm=1, dwell_s=0.0)
    assert run(planner, fleet(2, 1), 0.5, 0.8, 0.0) is None  # f = 1.2: inside [1/1.5, 1.5]
    assert planner.last_decision is not None and planner.last_decision.reason == "hold"
    planner.reset()
    assert run(planner, fleet(1, 1), 0.1, 3.0, 1.0) is None  # the prefill side keeps its one instance
    planner.reset()
    assert run(planner, fleet(2, 1, switchable=False), 0.1, 3.0, 2.0) is None  # none may switch


def test_both_pools_past_their_slo_and_near_balance_hold() -> None:
    """Both sides saturated within the band: a switch would only move the bottleneck, so none is planned."""
    planner = SwitchPlanner(RATIO, window=4, num_confirm=1, dwell_s=0.0)
    for now, (prefill, decode) in enumerate([(1.4, 1.6), (1.6, 1.4), (2.0, 2.5), (2.5, 2.0)]):
        assert run(planner, fleet(2, 2), prefill, decode, float(now)) is None
    assert planner.last_decision is not None and planner.last_decision.reason.startswith("scale_out")
    assert run(planner, fleet(2, 2), 0.2, 9.0, 5.0) is not None  # far outside the band, it switches


def test_a_flip_flopping_signal_never_confirms() -> None:
    planner = SwitchPlanner(RATIO, window=1, num_confirm=2, dwell_s=0.0)
    for step in range(10):
        hot_decode = step % 2 == 0
        assert run(planner, fleet(2, 2), 0.1 if hot_decode else 3.0, 3.0 if hot_decode else 0.1, step) is None


@given(st.lists(st.tuples(st.floats(0, 50), st.floats(0, 50)), min_size=1, max_size=30),
       st.integers(0, 3), st.integers(0, 3))
def test_plans_always_respect_the_pools(loads: list[tuple[float, float]], num_prefill: int, num_decode: int) -> None:
    planner = SwitchPlanner(RATIO, window=5, num_confirm=1, dwell_s=2.0)
    last_switch = None
    for now, (prefill, decode) in enumerate(loads):
        plan = run(planner, fleet(num_prefill, num_decode), prefill, decode, float(now))
        if plan is None:
            continue
        assert last_switch is None or now - last_switch >= 2.0
        remaining = (num_prefill if plan.from_role == "prefill" else num_decode) - 1
        factor = plan.decision.imbalance_factor
        assert not 1 / (1 + RATIO.tolerance) <= factor <= 1 + RATIO.tolerance
        assert remaining >= RATIO.min_per_side and plan.to_role != plan.from_role
        planner.switched(plan.name, float(now))
        last_switch = now
