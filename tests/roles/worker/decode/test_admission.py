"""Decode admission per policy: what RESERVE refuses, what waits for room, what is refused after prefill."""

from __future__ import annotations

import asyncio

import pytest

from mooncaked.roles.worker.decode.admission import (DecodeLoadNow, Room, StepLimit, refusal_after_prefill,
                                                     reserve_refusal)
from mooncaked.sched.predictors import DecodeStepPredictor

LIMIT = StepLimit(DecodeStepPredictor((0.0, 0.010, 0.0)), fallback_step_s=0.0, tbt_slo_s=0.05)  # 10 ms per seq
POLICIES = ("none", "baseline", "early_rejection", "early_rejection_predicted")


@pytest.mark.parametrize("admission", POLICIES)
def test_hard_limits_are_refused_under_every_policy(admission: str) -> None:
    no_pages = DecodeLoadNow(num_free_pages=3, num_seqs=0, num_context_tokens=0)
    assert reserve_refusal(admission, no_pages, 4, 100, 8, LIMIT).startswith("memory")
    full = DecodeLoadNow(num_free_pages=100, num_seqs=8, num_context_tokens=0)
    assert reserve_refusal(admission, full, 4, 100, 8, LIMIT).startswith("batch")


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


async def test_a_waiting_reserve_wakes_when_room_is_freed_and_gives_up_at_its_deadline() -> None:
    room = Room()
    free = {"pages": 0}

    def refusal() -> str:
        return "" if free["pages"] >= 2 else "memory: wait"

    waiter = asyncio.ensure_future(room.wait_until(refusal, 5.0))
    await asyncio.sleep(0)
    assert not waiter.done()
    free["pages"] = 1
    await room.freed()
    await asyncio.sleep(0)
    assert not waiter.done()  # woken, but still not enough room: waits again
    free["pages"] = 2
    await room.freed()
    assert await asyncio.wait_for(waiter, 1.0) == ""
    free["pages"] = 0
    assert await room.wait_until(refusal, 0.01) == "memory: wait"
