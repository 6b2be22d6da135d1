"""Instance views: an instance's reported held work plus this conductor's requests it has not counted; per-request
predicted ends from the output-length predictor."""

from __future__ import annotations

import math
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncaked.config import InstanceConfig
from mooncaked.roles.conductor.view.instances import (InFlight, OutputForecast, WorkerState, decode_view, inline_wait_s,
                                                      page_holds, prefill_view)
from mooncaked.roles.conductor.view.predictors import LivePredictors
from mooncaked.roles.worker.messages import LoadReply
from mooncaked.sched.output_length import OutputLengthPredictor
from mooncaked.sched.predictors import DecodeStepPredictor, Predictors, PrefillTimePredictor, TransferTimePredictor

MODEL = [0.0, 1.0, -1.0, 0.0, 0.0, 0.0]  # 1 s per 1000 new tokens


def predictors() -> LivePredictors:
    return LivePredictors(Predictors(PrefillTimePredictor((9.0, 0, 0, 0, 0, 0)), DecodeStepPredictor((0.5, 0, 0)),
                                     TransferTimePredictor(1, 1.0)))


def worker(role: str, load: LoadReply | None, polled_at: float = 0.0) -> WorkerState:
    return WorkerState(InstanceConfig(name="w", role=role), "s", 8, 1000, load=load, polled_at=polled_at, is_up=True)


def flight(request_id: str, predicted_s: float, **extra: object) -> InFlight:
    return InFlight(request_id, "w", "d", predicted_s, dispatched_at=1.0, ready_at=5.0, num_context_tokens=100,
                    **extra)  # type: ignore[arg-type]


def load(**fields: object) -> LoadReply:
    base: dict[str, object] = {"role": "prefill", "num_running": 1, "num_waiting": 1, "num_queued_tokens": 0,
                               "num_free_pages": 10, "num_pages": 10, "step_time_s": 0.0}
    return LoadReply(**{**base, **fields})  # type: ignore[arg-type]


def test_held_work_decays_and_uncounted_requests_are_added() -> None:
    live = predictors()
    live.report("w", MODEL, [])
    reply = load(prefill_coefficients=MODEL, pending_work_s=4.0, held_request_ids=["a"], overhead_s=0.05)
    flights = [flight("a", 1.0), flight("b", 2.0)]  # a is counted by the instance, b not yet
    view = prefill_view(worker("prefill", reply, polled_at=10.0), flights, live, now=11.0)
    assert view.queued_prefill_s == pytest.approx(3.0 + 2.0) and view.busy_until == 11.0
    assert view.prefill_coefficients == tuple(MODEL) and view.overhead_s == 0.05
    gone = prefill_view(worker("prefill", reply, polled_at=10.0), [], live, now=20.0)
    assert gone.queued_prefill_s == 0.0


def test_before_any_model_the_conductor_queue_model_stands() -> None:
    view = prefill_view(worker("prefill", None), [flight("a", 1.0), flight("b", 2.0)], predictors(), now=1.5)
    assert view.busy_until == pytest.approx(2.0) and view.queued_prefill_s == pytest.approx(2.0)
    assert view.prefill_coefficients == ()


def test_an_inline_prefill_waits_half_the_running_step_and_the_inline_prefills_ahead() -> None:
    live, now = predictors(), 10.0  # every decode step: 0.5 s
    idle = worker("decode", None)
    assert inline_wait_s(idle, [], live, now) == 0.0
    decoding = flight("a", 0.0, decode_started_at=2.0)
    assert inline_wait_s(idle, [decoding], live, now) == pytest.approx(0.25)
    queued = InFlight("b", "", "d", 0.3, dispatched_at=9.9, ready_at=now + 1.0, num_context_tokens=10)
    overdue = InFlight("c", "", "d", 0.3, dispatched_at=1.0, ready_at=now - 1.0, num_context_tokens=10)
    elsewhere = flight("e", 0.3)  # prefilled on a prefill instance: not on this compute thread
    assert inline_wait_s(idle, [decoding, queued, overdue, elsewhere], live, now) == pytest.approx(0.25 + 0.3)
    others = worker("decode", load(role="decode", num_running=3, num_context_tokens=900))
    assert inline_wait_s(others, [], live, now) == pytest.approx(0.25)  # other conductors' requests decode there


def test_decode_view_predicts_each_request_end_from_its_output_length() -> None:
    lengths = OutputLengthPredictor(quantile=1.0, min_samples=1)
    lengths.observe(api_key="k", max_tokens=100, num_prompt_tokens=100, num_output_tokens=20)
    forecast = OutputForecast(lengths, default_max_tokens=50, is_enabled=True)
    live = predictors()
    live.report("w", [], [0.1, 0.0, 0.0])  # 100 ms per step
    running = flight("a", 0.0, max_tokens=100, client_id="k", decode_started_at=2.0, num_generated=5)
    incoming = flight("b", 0.0, max_tokens=100, client_id="k")
    view = decode_view(worker("decode", None), [running, incoming], live, forecast, 16, now=3.0)
    assert view.running_ends_at == (pytest.approx(3.0 + 15 * 0.1),)
    assert view.incoming_decode_s == (pytest.approx(20 * 0.1),)
    assert view.step_coefficients == (0.1, 0.0, 0.0)
    uniform = decode_view(worker("decode", None), [running], live, OutputForecast(lengths, 50, False), 16, now=3.0)
    assert uniform.running_ends_at == () and uniform.incoming_decode_s == ()


def _load(**pipeline: object) -> LoadReply:
    return LoadReply("prefill", 0, 0, 0, 8, 8, 0.0, **pipeline)  # type: ignore[arg-type]


def test_a_group_pipeline_comes_from_its_first_stage_load() -> None:
    from mooncaked.roles.conductor.view.instances import pipeline_spec

    spec = pipeline_spec(_load(pipeline_stages=[MODEL, MODEL], pipeline_handoffs_s=[0.5], cpp_chunk_tokens=64))
    assert spec is not None and spec.chunk_tokens == 64 and spec.handoff_s == (0.5,)
    assert pipeline_spec(None) is None and pipeline_spec(_load()) is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.floats(allow_nan=True), max_size=7), max_size=4), st.integers(-5, 5000),
       st.lists(st.floats(), max_size=3))
def test_a_malformed_pipeline_report_is_no_pipeline(stages: list[list[float]], chunk: int,
                                                    handoffs: list[float]) -> None:
    """A LOAD reply off the wire never breaks placement: it forms a pipeline or none."""
    from mooncaked.roles.conductor.view.instances import pipeline_spec
    from mooncaked.sched.pipeline import PipelinePredictor

    spec = pipeline_spec(_load(pipeline_stages=stages, cpp_chunk_tokens=chunk, pipeline_handoffs_s=handoffs))
    if spec is not None:
        assert len(spec.stage_coefficients) >= 2 and spec.chunk_tokens >= 1
        assert math.isfinite(PipelinePredictor(spec).predict(2000, 100))


def test_pages_in_use_beyond_this_conductors_decoding_requests_are_other_conductors() -> None:
    """A request still in prefill holds no pages yet (it takes them at DECODE): only the decoding ones are
    subtracted from the pages LOAD says are in use."""
    lengths = OutputLengthPredictor(quantile=1.0, min_samples=1)
    forecast = OutputForecast(lengths, default_max_tokens=50, is_enabled=True)
    running = flight("a", 0.0, max_tokens=28, decode_started_at=2.0)  # 100 + 28 tokens: 8 pages of 16
    incoming = flight("b", 0.0, max_tokens=28)
    reported = load(role="decode", num_pages=100, num_free_pages=80, num_context_tokens=100)
    holds = page_holds(reported, [running, incoming], forecast, 16, 0.1, now=3.0)
    assert [h.num_pages for h in holds] == [8, 8, 20 - 8]
    assert holds[2].starts_at == 3.0 and holds[2].num_seqs == 0  # LOAD's one running sequence is "a"
    busier = page_holds(load(role="decode", num_pages=100, num_free_pages=80, num_running=3), [running, incoming],
                        forecast, 16, 0.1, now=3.0)
    assert busier[2].num_seqs == 2  # two sequences beyond this conductor's: two batch slots
    idle = page_holds(load(role="decode", num_pages=100, num_free_pages=92), [running, incoming], forecast, 16, 0.1,
                      now=3.0)
    assert [h.num_pages for h in idle] == [8, 8]
