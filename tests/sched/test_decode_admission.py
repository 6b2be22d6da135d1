"""Decode admission per policy (sched/decode_admission.py): what RESERVE refuses, what is refused after prefill,
and that the decode role and the simulator both run these functions."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncaked.sched.decode_admission import (DecodeLoadNow, StepLimit, capacity_refusal, refusal_after_prefill,
                                              rejection_reason, reserve_refusal)
from mooncaked.sched.predictors import DecodeStepPredictor

LIMIT = StepLimit(DecodeStepPredictor((0.0, 0.010, 0.0)), fallback_step_s=0.0, tbt_slo_s=0.05)  # 10 ms per seq
POLICIES = ("none", "baseline", "early_rejection", "early_rejection_predicted")


@pytest.mark.parametrize("admission", POLICIES)
def test_hard_limits_are_refused_under_every_policy(admission: str) -> None:
    no_pages = DecodeLoadNow(num_free_pages=3, num_seqs=0, num_context_tokens=0)
    assert reserve_refusal(admission, no_pages, 4, 100, 8, LIMIT).startswith("memory")
    full = DecodeLoadNow(num_free_pages=100, num_seqs=8, num_context_tokens=0)
    assert reserve_refusal(admission, full, 4, 100, 8, LIMIT).startswith("batch")
    room_for_one = DecodeLoadNow(num_free_pages=100, num_seqs=7, num_context_tokens=0)
    assert not reserve_refusal(admission, room_for_one, 4, 100, 8, LIMIT).startswith("batch")
    assert reserve_refusal(admission, room_for_one, 4, 100, 8, LIMIT, num_seqs=4).startswith("batch")  # n = 4


@pytest.mark.parametrize("admission", POLICIES)
def test_only_early_rejection_refuses_reserve_for_the_tbt_slo(admission: str) -> None:
    busy = DecodeLoadNow(num_free_pages=100, num_seqs=5, num_context_tokens=5000)  # 6 seqs -> 60 ms > 50 ms
    reason = reserve_refusal(admission, busy, 4, 100, 64, LIMIT)
    assert reason.startswith("tbt_slo") if admission == "early_rejection" else reason == ""
    after = refusal_after_prefill(admission, 5, 5000, 100, LIMIT)
    assert after.startswith("decode_refused_after_prefill") if admission == "baseline" else after == ""


def test_the_step_limit_falls_back_to_the_measured_mean_before_a_fit() -> None:
    limit = StepLimit(None, fallback_step_s=0.04, tbt_slo_s=0.05)
    assert limit.predict(1, 0) == pytest.approx(0.04) and limit.predict(4, 0) == pytest.approx(0.04 * 4 / 3)


def test_a_request_larger_than_the_instance_is_refused_for_good() -> None:
    assert capacity_refusal(9, 8) == "memory: needs 9 KV pages, the instance has 8"
    assert capacity_refusal(8, 8) == ""


@given(admission=st.sampled_from(POLICIES), free=st.integers(-5, 50), seqs=st.integers(0, 40),
       tokens=st.integers(0, 10**6), pages=st.integers(0, 60), prompt=st.integers(1, 10**5))
def test_the_reserve_rule_follows_its_definition(admission: str, free: int, seqs: int, tokens: int, pages: int,
                                                  prompt: int) -> None:
    reason = reserve_refusal(admission, DecodeLoadNow(free, seqs, tokens), pages, prompt, 32, LIMIT)
    step_s = LIMIT.predict(seqs + 1, tokens + prompt)
    if pages > free:
        assert reason.startswith("memory")
    elif seqs >= 32:
        assert reason.startswith("batch")
    elif admission == "early_rejection" and step_s > LIMIT.tbt_slo_s:
        assert reason.startswith("tbt_slo")
    else:
        assert reason == ""
    assert rejection_reason(reason) == ("decode_" + reason.split(":")[0] if reason else "decode_refused")


def test_the_decode_role_and_the_simulator_call_these_functions() -> None:
    from mooncaked.roles.worker.decode import admission, role
    from mooncaked.sim import decode_reserve, engine

    assert admission.reserve_refusal is reserve_refusal and decode_reserve.reserve_refusal is reserve_refusal
    assert role.refusal_after_prefill is refusal_after_prefill and engine.refusal_after_prefill is refusal_after_prefill
    assert role.capacity_refusal is capacity_refusal and engine.capacity_refusal is capacity_refusal
