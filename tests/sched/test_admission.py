"""Admission policies on constructed decode load patterns."""

import pytest

from mooncaked.sched.admission import predicted_batch, select_decode
from mooncaked.sched.algorithm import SchedulerPolicy, schedule
from mooncaked.sched.decode_admission import StepLimit, refusal_after_prefill
from mooncaked.sched.decode_memory import DecodeHold
from mooncaked.sched.predictors import DecodeStepPredictor, Predictors, PrefillTimePredictor, TransferTimePredictor
from mooncaked.sched.shadow_index import ShadowIndex
from mooncaked.sched.types import DecodeInstanceView, Placement, PolicyConfig, PrefillInstanceView, Rejection, RequestInfo

PREFILL = PrefillTimePredictor((0.0, 1.0, -1.0, 0.0, 0.0, 0.0))  # 1 s per 1000 new tokens
DECODE = DecodeStepPredictor((0.0, 0.010, 0.0))  # 10 ms per request in the batch
REQUEST = RequestInfo("r", 2000, ())  # 2 s prefill on an idle instance -> ready at now + 2


def _policy(admission: str, **extra) -> SchedulerPolicy:
    config = PolicyConfig(admission=admission, tbt_slo_s=0.05, ttft_slo_s=10.0, decode_time_s=5.0, **extra)
    return SchedulerPolicy(config, Predictors(PREFILL, DECODE, TransferTimePredictor(1, 1.0)))


def _decide(decode: DecodeInstanceView, admission: str, now: float = 100.0):
    prefills = [PrefillInstanceView("p", "sp")]
    return schedule(REQUEST, prefills, [decode], ShadowIndex(), _policy(admission), now)


# Lag pattern (Fig. 7a): the batch is empty now, but 5 requests placed here finish prefill within 1 s.
FILLING = DecodeInstanceView("d", "sd", 0, 0, 64, 10**9, incoming=tuple((101.0, 1000) for _ in range(5)))
# Draining pattern: 5 requests running now, all started 10 s ago (> t_d = 5 s): expected gone by now + 2.
DRAINING = DecodeInstanceView(
    "d", "sd", 5, 5000, 64, 10**9, running_started_at=(90.0,) * 5, running_tokens=(1000,) * 5
)


def test_early_rejection_uses_the_current_batch():
    # FILLING: 0 running + this one -> 10 ms <= 50 ms: accepted (the lag the prediction fixes).
    assert isinstance(_decide(FILLING, "early_rejection"), Placement)
    # DRAINING: 5 running + 1 -> 60 ms > 50 ms: rejected.
    rejected = _decide(DRAINING, "early_rejection")
    assert isinstance(rejected, Rejection) and rejected.reason == "tbt_slo"
    assert rejected.predicted_tbt_s == pytest.approx(0.060)


def test_prediction_based_early_rejection_looks_at_prefill_completion():
    # At ready time 102: FILLING has 5 joined (at 101, still within t_d) + 1 -> 60 ms: rejected.
    rejected = _decide(FILLING, "early_rejection_predicted")
    assert isinstance(rejected, Rejection) and rejected.reason == "tbt_slo"
    # DRAINING at 102: all 5 started at 90, 90 + 5 <= 102 -> gone; 1 request -> 10 ms: accepted.
    accepted = _decide(DRAINING, "early_rejection_predicted")
    assert isinstance(accepted, Placement) and accepted.predicted_tbt_s == pytest.approx(0.010)


def test_baseline_defers_the_decode_check_until_after_prefill():
    placement = _decide(DRAINING, "baseline")
    assert isinstance(placement, Placement)  # not refused up front...
    limit = StepLimit(DECODE, 0.0, _policy("baseline").config.tbt_slo_s)
    # ...but the decode instance refuses later (5 running + this one: 60 ms > 50 ms), an empty one does not
    assert refusal_after_prefill("baseline", DRAINING.num_running, DRAINING.num_context_tokens, 1000, limit)
    assert not refusal_after_prefill("baseline", FILLING.num_running, FILLING.num_context_tokens, 1000, limit)


def test_none_never_rejects():
    slow = DecodeInstanceView("d", "sd", 50, 50_000, 64, 10**9)
    long_request = RequestInfo("r", 50_000, ())  # 50 s prefill > 10 s TTFT SLO
    decision = schedule(long_request, [PrefillInstanceView("p", "sp")], [slow], ShadowIndex(), _policy("none"), 0.0)
    assert isinstance(decision, Placement)


def test_decode_memory_full_rejects_early():
    full = DecodeInstanceView("d", "sd", 1, 9_000, 64, 10_000)
    rejected = _decide(full, "early_rejection")
    assert isinstance(rejected, Rejection) and rejected.reason == "decode_full"


def test_predicted_batch_and_selection():
    assert predicted_batch(FILLING, 100.5, 5.0) == (0, 0)
    assert predicted_batch(FILLING, 101.0, 5.0) == (5, 5000)
    assert predicted_batch(FILLING, 106.0, 5.0) == (0, 0)
    config = _policy("early_rejection_predicted").config
    choice = select_decode(1000, [FILLING, DRAINING], config, DECODE, now=100.0, ready_time=102.0)
    assert choice.view is DRAINING


def test_predicted_ends_replace_the_uniform_decode_time():
    # DRAINING's requests started 10 s ago: under t_d = 5 s they are gone by the request's ready time (now + 2);
    # an output-length prediction says three of them still run until now + 30
    still_running = DecodeInstanceView("d", "sd", 5, 5000, 64, 10**9, running_started_at=(90.0,) * 5,
                                       running_tokens=(1000,) * 5, running_ends_at=(130.0,) * 3 + (95.0,) * 2)
    assert predicted_batch(DRAINING, 102.0, 5.0) == (0, 0)
    assert predicted_batch(still_running, 102.0, 5.0) == (3, 3000)
    # FILLING's incoming requests decode for 5 s under t_d; predicted to finish after 0.5 s, they are gone at 102
    short = DecodeInstanceView("d", "sd", 0, 0, 64, 10**9, incoming=FILLING.incoming,
                               incoming_decode_s=(0.5,) * 5)
    assert predicted_batch(FILLING, 102.0, 5.0) == (5, 5000) and predicted_batch(short, 102.0, 5.0) == (0, 0)


def test_an_instance_predicts_with_its_own_reported_step_model():
    slow = DecodeInstanceView("d", "sd", 1, 100, 64, 10**9, step_coefficients=(0.2, 0.0, 0.0))
    rejected = _decide(slow, "early_rejection")
    assert isinstance(rejected, Rejection) and rejected.predicted_tbt_s == pytest.approx(0.2)
    fast = PrefillInstanceView("p", "sp", prefill_coefficients=(0.0, 0.1, -0.1, 0.0, 0.0, 0.0), overhead_s=0.05)
    placed = schedule(REQUEST, [fast], [FILLING], ShadowIndex(), _policy("early_rejection"), 100.0)
    assert isinstance(placed, Placement)
    assert placed.predicted_prefill_s == pytest.approx(0.2) and placed.predicted_ttft_s == pytest.approx(0.25)


def test_a_decode_start_is_deferred_to_when_the_forecast_frees_its_pages_within_the_ttft_slo():
    """2000 prompt tokens + 100 output in blocks of 64: 33 pages of 40. Ready at 102 (2 s prefill); the 30 pages
    held now free at 105 (a 3 s deferral, within the 10 s TTFT SLO less the 2 s TTFT) or at 111 (9 s: past it)."""
    request = RequestInfo("r", 2000, (), max_tokens=100)

    def decide(ends_at: float):
        holds = (DecodeHold(30, 100.0, ends_at),)
        decode = DecodeInstanceView("d", "sd", 1, 2000, 64, 10**9, num_pages=40, page_holds=holds)
        return schedule(request, [PrefillInstanceView("p", "sp")], [decode], ShadowIndex(),
                        _policy("early_rejection_predicted", block_size=64, max_decode_defer_s=10.0), 100.0)

    deferred = decide(105.0)
    assert isinstance(deferred, Placement) and deferred.predicted_ttft_s == pytest.approx(2.0)
    assert deferred.decode_defer_s == pytest.approx(3.0) and deferred.predicted_decode_start_s == pytest.approx(5.0)
    now_free = decide(101.0)
    assert isinstance(now_free, Placement) and now_free.decode_defer_s == 0.0
    too_late = decide(111.0)
    assert isinstance(too_late, Rejection) and too_late.reason == "decode_full"


def test_an_instance_with_room_at_the_decode_start_is_preferred_to_a_deferred_one():
    config = _policy("early_rejection_predicted", block_size=64, max_decode_defer_s=10.0).config
    busy = DecodeInstanceView("busy", "sb", 0, 0, 64, 10**9, num_pages=40, page_holds=(DecodeHold(30, 100.0, 104.0),))
    idle = DecodeInstanceView("idle", "si", 3, 3000, 64, 10**9, num_pages=40)
    choice = select_decode(2000, [busy, idle], config, DECODE, now=100.0, ready_time=102.0, num_pages=33,
                           max_defer_s=8.0)
    assert choice.view is idle and choice.decode_defer_s == 0.0 and choice.has_room


def test_no_deferral_past_the_configured_limit():
    request = RequestInfo("r", 2000, (), max_tokens=100)
    holds = (DecodeHold(30, 100.0, 105.0),)
    decode = DecodeInstanceView("d", "sd", 1, 2000, 64, 10**9, num_pages=40, page_holds=holds)
    for limit_s, is_placed in ((3.0, True), (2.9, False), (0.0, False)):
        policy = _policy("early_rejection_predicted", block_size=64, max_decode_defer_s=limit_s)
        result = schedule(request, [PrefillInstanceView("p", "sp")], [decode], ShadowIndex(), policy, 100.0)
        assert isinstance(result, Placement) == is_placed, (limit_s, result)


def test_a_parallel_sampling_counts_its_shared_prompt_pages_once_and_a_slot_per_sequence() -> None:
    """2000 prompt tokens (31 full blocks of 64 and a partial one) + 100 output, n = 4: 31 shared pages and 2 of
    each sequence's own, 39 of 40 (4 separate copies would take 132); and 4 batch slots, not 1."""
    request = RequestInfo("r", 2000, (), max_tokens=100, num_sequences=4)
    policy = _policy("early_rejection_predicted", block_size=64)

    def decide(max_num_running: int) -> Placement | Rejection:
        decode = DecodeInstanceView("d", "sd", 1, 2000, max_num_running, 10**9, num_pages=40,
                                    page_holds=(DecodeHold(1, 100.0, 200.0),))
        return schedule(request, [PrefillInstanceView("p", "sp")], [decode], ShadowIndex(), policy, 100.0)

    assert isinstance(decide(5), Placement)
    full = decide(4)  # one slot held: 4 more do not fit
    assert isinstance(full, Rejection) and full.reason == "decode_full"
    more_pages = schedule(RequestInfo("r", 2000, (), max_tokens=200, num_sequences=4), [PrefillInstanceView("p", "sp")],
                          [DecodeInstanceView("d", "sd", 1, 2000, 64, 10**9, num_pages=40)], ShadowIndex(), policy,
                          100.0)
    assert isinstance(more_pages, Rejection) and more_pages.reason == "decode_full"  # 31 + 4 * 4 > 40


def test_a_request_its_prefill_first_token_ends_is_placed_beside_a_full_decode_instance() -> None:
    """max_tokens 1: it never joins the decode batch or takes its pages (sched/decode_memory.is_decoding), so neither
    a full batch nor full pages nor a slow step refuse it; of two instances it goes to the less loaded."""
    full_pages = DecodeInstanceView("d0", "s0", 1, 1000, 64, 1000, num_pages=10,
                                    page_holds=(DecodeHold(10, 100.0, 1000.0),))  # its context and pages are full
    slow = DecodeInstanceView("d1", "s1", 64, 64_000, 64, 10**9, running_started_at=(100.0,) * 64,
                              running_tokens=(1000,) * 64)  # 64 running until 105: 640 ms steps, batch full
    prefills = [PrefillInstanceView("p", "sp")]
    for admission in ("early_rejection", "early_rejection_predicted"):
        for views in ([full_pages], [slow], [slow, full_pages]):
            decoding = schedule(RequestInfo("r", 2000, (), max_tokens=8), prefills, views, ShadowIndex(),
                                _policy(admission), 100.0)
            assert isinstance(decoding, Rejection) and decoding.reason in ("decode_full", "tbt_slo")
            first_only = schedule(RequestInfo("r", 2000, (), max_tokens=1), prefills, views, ShadowIndex(),
                                  _policy(admission), 100.0)
            assert isinstance(first_only, Placement) and first_only.predicted_tbt_s == 0.0
            assert first_only.decode_instance == ("d0" if len(views) == 2 else views[0].instance_id)
    choice = select_decode(2000, [slow, full_pages], _policy("early_rejection_predicted").config, DECODE, 100.0,
                           102.0, num_pages=0, num_sequences=0)
    assert choice.view is full_pages and choice.has_room and choice.decode_defer_s == 0.0
