"""The switch planner (sched/pd_switch.py): a switch only when it pays for itself, with persistence and dwell
scaled by its cost, and no flip-flop under noisy load signals."""

from __future__ import annotations

import json

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncaked.sched.pd_gain import excess, switch_gain
from mooncaked.sched.pd_ratio import PdRatioConfig
from mooncaked.sched.pd_switch import SwitchCandidate, SwitchPlanner, SwitchPolicy

RATIO = PdRatioConfig(tolerance=0.5, scale_out_load=0.9, scale_in_load=0.05, min_per_side=1)


def policy(**changes: float) -> SwitchPolicy:
    values: dict[str, float] = dict(window=4, num_confirm=3, dwell_s=5.0, interval_s=1.0, horizon_s=60.0,
                                    gain_margin=2.0, default_switch_cost_s=2.0, dwell_per_cost=3.0,
                                    reversal_factor=2.0)
    values.update(changes)
    return SwitchPolicy(RATIO, **values)  # type: ignore[arg-type]


def fleet(num_prefill: int, num_decode: int, switchable: bool = True) -> list[SwitchCandidate]:
    return ([SwitchCandidate(f"p{i}", "prefill", switchable, True, i / 10, None) for i in range(num_prefill)]
            + [SwitchCandidate(f"d{i}", "decode", switchable, True, i / 10, None) for i in range(num_decode)])


def run(planner: SwitchPlanner, candidates: list[SwitchCandidate], prefill: float, decode: float, now: float):
    planner.observe(prefill, decode)
    return planner.plan(candidates, now)


def test_the_gain_is_the_demand_a_switch_brings_within_the_slos() -> None:
    assert excess(2.0, 2, 2, 0.9) == 2.0 * 2 - 0.9 * 2
    # decode at 2x its capacity on 2 instances, prefill at 0.3 on 4: one more decode instance serves 0.9 more
    assert switch_gain(0.3, 2.0, 4, 2, "prefill", 0.9) == pytest.approx(0.9)
    assert switch_gain(1.5, 1.5, 3, 3, "prefill", 0.9) == pytest.approx(0.0)  # both saturated: only moves it
    assert switch_gain(0.2, 0.5, 3, 3, "prefill", 0.9) == 0.0  # both meet their SLOs: nothing to gain


def test_a_hot_decode_pool_takes_the_least_loaded_prefill_once_it_persists() -> None:
    planner = SwitchPlanner(policy())
    candidates = fleet(2, 1)
    assert run(planner, candidates, 0.1, 2.0, 0.0) is None
    assert run(planner, candidates, 0.1, 2.0, 1.0) is None
    plan = run(planner, candidates, 0.1, 2.0, 2.0)
    assert plan is not None and (plan.name, plan.from_role, plan.to_role) == ("p0", "prefill", "decode")
    assert plan.gain > 0 and plan.cost_s == 2.0
    planner.switched(plan.name, 2.0, cost_s=4.0, from_role="prefill")
    assert planner.cost_of(SwitchCandidate("p0", "prefill", True, True, 0.0, None)) == 4.0
    # dwell: max(5 s, 3 x 4 s) = 12 s; and a reversal needs twice the persistence (2 x max(3, 4 s) periods)
    for now in range(3, 14):
        assert run(planner, fleet(1, 2), 3.0, 0.1, float(now)) is None
    assert run(planner, fleet(1, 2), 3.0, 0.1, 14.0) is not None


def test_a_switch_costs_its_measured_time_in_its_direction_and_at_least_the_work_it_holds() -> None:
    planner = SwitchPlanner(policy())
    planner.switched("p0", 1.0, cost_s=4.0, from_role="prefill")
    assert planner.cost_of(SwitchCandidate("p0", "prefill", True, True, 0.0, None)) == 4.0
    assert planner.cost_of(SwitchCandidate("p0", "decode", True, True, 0.0, None)) == 4.0  # the other way's
    planner.switched("p0", 20.0, cost_s=1.0, from_role="decode")
    assert planner.cost_of(SwitchCandidate("p0", "decode", True, True, 0.0, None)) == 1.0
    assert planner.cost_of(SwitchCandidate("p0", "prefill", True, True, 0.0, None)) == 4.0
    assert planner.cost_of(SwitchCandidate("p1", "decode", True, True, 0.0, None)) == 2.0  # never measured
    assert planner.cost_of(SwitchCandidate("p0", "decode", True, True, 0.0, None, drain_s=9.0)) == 9.0
    assert json.loads(json.dumps(planner.measured_costs())) == {"p0 from prefill": 4.0, "p0 from decode": 1.0}


def test_a_switch_that_costs_more_than_it_brings_is_not_made() -> None:
    planner = SwitchPlanner(policy(horizon_s=10.0, default_switch_cost_s=30.0))
    for now in range(20):  # gain 0.9 instances x 10 s < 2 x 30 s
        assert run(planner, fleet(4, 2), 0.3, 2.0, float(now)) is None
    assert planner.last_gain > 0


def test_the_hysteresis_band_both_pools_saturated_and_the_minimum_per_side_hold() -> None:
    planner = SwitchPlanner(policy(num_confirm=1, dwell_s=0.0, default_switch_cost_s=0.0))
    assert run(planner, fleet(2, 1), 0.5, 0.8, 0.0) is None  # f = 1.2: inside [1/1.5, 1.5]
    assert planner.last_decision is not None and planner.last_decision.reason == "hold"
    planner.reset()
    for now, (prefill, decode) in enumerate([(1.4, 1.6), (2.0, 2.5), (2.5, 2.0)]):
        assert run(planner, fleet(2, 2), prefill, decode, float(now)) is None  # only moves the bottleneck
    planner.reset()
    assert run(planner, fleet(1, 1), 0.1, 3.0, 5.0) is None  # the prefill side keeps its one instance
    planner.reset()
    assert run(planner, fleet(2, 1, switchable=False), 0.1, 3.0, 6.0) is None  # none may switch


def test_a_flip_flopping_signal_never_confirms() -> None:
    planner = SwitchPlanner(policy(window=1, num_confirm=2, dwell_s=0.0))
    for step in range(10):
        hot_decode = step % 2 == 0
        assert run(planner, fleet(2, 2), 0.1 if hot_decode else 3.0, 3.0 if hot_decode else 0.1, step) is None


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), prefill=st.floats(0.05, 0.8), decode=st.floats(0.05, 0.8))
def test_noise_on_steady_loads_within_the_slos_never_switches(seed: int, prefill: float, decode: float) -> None:
    """Load samples x a random factor in [0.7, 1.5] (the noise a busy host puts on step times): no switch."""
    rng = random.Random(seed)
    planner = SwitchPlanner(policy(window=10, dwell_s=0.0))
    for now in range(300):
        plan = run(planner, fleet(3, 3), prefill * rng.uniform(0.7, 1.5), decode * rng.uniform(0.7, 1.5),
                   float(now))
        assert plan is None


@given(st.lists(st.tuples(st.floats(0, 50), st.floats(0, 50)), min_size=1, max_size=30),
       st.integers(0, 3), st.integers(0, 3))
def test_plans_always_respect_the_pools(loads: list[tuple[float, float]], num_prefill: int, num_decode: int) -> None:
    planner = SwitchPlanner(policy(window=5, num_confirm=1, dwell_s=2.0, default_switch_cost_s=0.0))
    last_switch = None
    for now, (prefill, decode) in enumerate(loads):
        plan = run(planner, fleet(num_prefill, num_decode), prefill, decode, float(now))
        if plan is None:
            continue
        assert last_switch is None or now - last_switch >= 2.0
        remaining = (num_prefill if plan.from_role == "prefill" else num_decode) - 1
        factor = plan.decision.imbalance_factor
        assert not 1 / (1 + RATIO.tolerance) <= factor <= 1 + RATIO.tolerance
        assert remaining >= RATIO.min_per_side and plan.to_role != plan.from_role and plan.gain > 0
        planner.switched(plan.name, float(now), 0.0, plan.from_role)
        last_switch = now
