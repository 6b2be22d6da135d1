"""Inline prefill on a decode instance (sched/inline.py) on hand-built clusters, and that the conductor's placer
and the simulator both place through it."""

from __future__ import annotations

import dataclasses

import pytest

from mooncaked.sched.algorithm import SchedulerPolicy
from mooncaked.sched.inline import place
from mooncaked.sched.predictors import DecodeStepPredictor, Predictors, PrefillTimePredictor, TransferTimePredictor
from mooncaked.sched.shadow_index import ShadowIndex
from mooncaked.sched.types import (DecodeInstanceView, Placement, PolicyConfig, PrefillInstanceView, Rejection,
                                   RequestInfo)

# Prefill: 1 s per 1000 new tokens (coefficients on (1, n, p, n^2, np, p^2), n and p in thousands).
PREFILL = PrefillTimePredictor((0.0, 1.0, -1.0, 0.0, 0.0, 0.0))
DECODE = DecodeStepPredictor((0.010, 0.0, 0.0))  # 10 ms a step
KEYS = tuple(f"k{i}" for i in range(10))
REQUEST = RequestInfo("r1", num_prompt_tokens=10_000, block_keys=KEYS)  # 10 blocks of 1000 tokens
POLICY = SchedulerPolicy(PolicyConfig(block_size=1000, ttft_slo_s=30.0, tbt_slo_s=0.1),
                         Predictors(PREFILL, DECODE, TransferTimePredictor(1, 1.0)))
# d0's host store holds 9 of the 10 blocks: 1000 tokens (the last block, at most all but one token) to compute.
D0 = DecodeInstanceView("d0", "s-d0", 0, 0, 64, 1_000_000, inline_max_tokens=1000, inline_wait_s=0.5,
                        inline_overhead_s=0.25)
D1 = DecodeInstanceView("d1", "s-d1", 1, 0, 64, 1_000_000, inline_max_tokens=1000)
PREFILLS = [PrefillInstanceView("p0", "s-p0")]


def _index(holdings: dict[str, int]) -> ShadowIndex:
    index = ShadowIndex()
    for store, num_blocks in holdings.items():
        index.apply_dump(store, 0, KEYS[:num_blocks])
    return index


def test_without_prefill_instances_every_prompt_is_prefilled_inline() -> None:
    decision = place(REQUEST, [], [dataclasses.replace(D0, inline_max_tokens=0)], _index({}), POLICY, 0.0)
    # nothing cached: 10 s of prefill, after the 0.5 s wait, plus the 0.25 s overhead
    assert isinstance(decision, Placement) and decision.prefill_instance == "" and decision.decode_instance == "d0"
    assert decision.predicted_ttft_s == pytest.approx(10.75)


def test_a_decode_instance_holding_the_prefix_prefills_the_rest_itself() -> None:
    decision = place(REQUEST, PREFILLS, [D0, D1], _index({"s-d0": 9}), POLICY, 0.0)
    assert isinstance(decision, Placement) and decision.prefill_instance == ""
    assert decision.num_prefix_blocks == 9 and decision.predicted_prefill_s == pytest.approx(1.0)
    assert decision.predicted_ttft_s == pytest.approx(1.75)
    # with 8 blocks there, 2000 tokens are left: Algorithm 1's prefill instance takes it
    decision = place(REQUEST, PREFILLS, [D0, D1], _index({"s-d0": 8}), POLICY, 0.0)
    assert isinstance(decision, Placement) and decision.prefill_instance == "p0"


def test_inline_is_the_fallback_when_no_prefill_instance_can_take_the_request() -> None:
    down = [dataclasses.replace(PREFILLS[0], is_available=False)]
    decision = place(REQUEST, down, [D0, D1], _index({"s-d0": 9}), POLICY, 0.0)
    assert isinstance(decision, Placement) and decision.decode_instance == "d0" and decision.prefill_instance == ""
    refused = place(REQUEST, down, [D0, D1], _index({"s-d0": 5}), POLICY, 0.0)
    assert isinstance(refused, Rejection) and refused.reason == "no_prefill_instance"


def test_an_inline_prefill_past_the_ttft_slo_is_rejected_early() -> None:
    slow = dataclasses.replace(D0, inline_wait_s=40.0)
    refused = place(REQUEST, [], [slow], _index({"s-d0": 9}), POLICY, 0.0)
    assert isinstance(refused, Rejection) and refused.reason == "ttft_slo"
    assert refused.predicted_ttft_s == pytest.approx(41.25)


def test_the_instance_s_own_prefill_model_prices_its_inline_prefill() -> None:
    fast = dataclasses.replace(D0, prefill_coefficients=(0.0, 0.5, -0.5, 0.0, 0.0, 0.0))  # 0.5 s per 1000
    decision = place(REQUEST, [], [fast], _index({}), POLICY, 0.0)
    assert isinstance(decision, Placement) and decision.predicted_prefill_s == pytest.approx(5.0)


def test_the_placer_and_the_simulator_place_through_this_rule() -> None:
    from mooncaked.roles.conductor import placement
    from mooncaked.sim import engine

    assert placement.place is place and engine.place is place


def test_a_decode_instance_s_device_tier_counts_as_its_prefix() -> None:
    # d0's store holds 5 blocks, its device prefix cache 9: 1000 tokens left, within its inline_max_tokens
    d0 = dataclasses.replace(D0, device_id="d0")
    decision = place(REQUEST, PREFILLS, [d0, D1], _index({"s-d0": 5}), POLICY, 0.0, device_index=_index({"d0": 9}))
    assert isinstance(decision, Placement) and decision.prefill_instance == ""
    assert decision.num_prefix_blocks == 9 and decision.predicted_ttft_s == pytest.approx(1.75)
    # without the device index only the store's 5 count: Algorithm 1's prefill instance takes it
    decision = place(REQUEST, PREFILLS, [d0, D1], _index({"s-d0": 5}), POLICY, 0.0)
    assert isinstance(decision, Placement) and decision.prefill_instance == "p0"
