"""A prefill group's predicted time (fill, steady state, drain) and Algorithm 1 choosing groups for long prompts."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncaked.sched.algorithm import SchedulerPolicy, eligible_prefill, schedule
from mooncaked.sched.pipeline import (PipelinePredictor, chunk_bounds, even_pipeline, pipeline_seconds,
                                      split_predictor)
from mooncaked.sched.predictors import DecodeStepPredictor, Predictors, PrefillTimePredictor, TransferTimePredictor
from mooncaked.sched.shadow_index import ShadowIndex
from mooncaked.sched.types import (DecodeInstanceView, PipelineSpec, Placement, PolicyConfig, PrefillInstanceView,
                                   RequestInfo)

# 1 s per 1000 new tokens, no constant, no attention term (coefficients on (1, n, p, n^2, np, p^2), thousands).
LINEAR = PrefillTimePredictor((0.0, 1.0, -1.0, 0.0, 0.0, 0.0))
HALF = PrefillTimePredictor((0.0, 0.5, -0.5, 0.0, 0.0, 0.0))


def test_chunk_bounds_cover_the_new_tokens_once() -> None:
    assert chunk_bounds(1000, 0, 400) == [(0, 400), (400, 800), (800, 1000)]
    assert chunk_bounds(1000, 600, 400) == [(600, 1000)]
    assert chunk_bounds(1000, 1000, 400) == [(999, 1000)]  # the last token is always computed


def test_one_chunk_runs_the_stages_one_after_the_other() -> None:
    # 1000 tokens in one chunk: 0.5 s on stage 0, 0.1 s handoff, 0.5 s on stage 1.
    spec = PipelineSpec((HALF.coefficients, HALF.coefficients), chunk_tokens=1000, handoff_s=(0.1,))
    assert PipelinePredictor(spec).predict(1000, 0) == pytest.approx(1.1)


def test_many_chunks_overlap_the_stages() -> None:
    # 4 chunks of 250 tokens: 0.125 s per stage and chunk. Stage 0 ends chunk j at 0.125 (j + 1); stage 1 starts
    # chunk 0 at 0.125 and then runs back to back: 0.125 + 4 * 0.125 = 0.625 s (fill one chunk, then 4 chunks).
    spec = PipelineSpec((HALF.coefficients, HALF.coefficients), chunk_tokens=250)
    assert PipelinePredictor(spec).predict(1000, 0) == pytest.approx(0.625)
    # a slow handoff paces stage 1: chunk j arrives at 0.125 (j + 1) + 0.2; the last at 0.7, done at 0.825
    slow = PipelineSpec((HALF.coefficients, HALF.coefficients), chunk_tokens=250, handoff_s=(0.2,))
    assert PipelinePredictor(slow).predict(1000, 0) == pytest.approx(0.825)


def test_a_cached_prefix_is_not_recomputed() -> None:
    spec = PipelineSpec((HALF.coefficients, HALF.coefficients), chunk_tokens=250)
    assert PipelinePredictor(spec).predict(1500, 500) == pytest.approx(0.625)


def test_split_predictor_shares_the_token_terms() -> None:
    whole = PrefillTimePredictor((0.02, 1.0, -1.0, 0.4, 0.0, -0.4))
    first, second = split_predictor(whole, [0.25, 0.75])
    assert first == (0.02, 0.25, -0.25, 0.1, 0.0, -0.1) and second[1] == pytest.approx(0.75)


def test_an_even_pipeline_splits_the_whole_model_over_its_stages() -> None:
    whole = PrefillTimePredictor((0.02, 1.0, -1.0, 0.4, 0.0, -0.4))
    spec = even_pipeline(whole, 4, chunk_tokens=256, handoff_s=0.003)
    assert spec.stage_coefficients == split_predictor(whole, [0.25] * 4)
    assert spec.chunk_tokens == 256 and spec.handoff_s == (0.003,) * 3
    assert even_pipeline(whole, 2, chunk_tokens=256).handoff_s == ()  # no handoff: the conductor's default
    # one chunk through 4 quarter stages and 3 handoffs: the whole model's work, 3 more constants and handoffs
    assert PipelinePredictor(spec).predict(256, 0) == pytest.approx(whole.predict(256, 0) + 3 * (0.02 + 0.003))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 0.05), st.floats(0, 2), st.floats(0, 1)), min_size=2, max_size=4),
       st.integers(1, 20_000), st.integers(0, 20_000), st.integers(1, 4096), st.floats(0, 0.1))
def test_pipeline_time_is_bounded_by_its_stages(stage_terms: list[tuple[float, float, float]], num_tokens: int,
                                                num_prefix: int, chunk_tokens: int, handoff: float) -> None:
    """At least the busiest stage's own work (plus the fill of the others' first and last chunk); at most every
    stage's work one after the other plus every handoff of every chunk."""
    stages = [PrefillTimePredictor((c, a, -a, b, 0.0, -b)) for c, a, b in stage_terms]
    bounds = chunk_bounds(num_tokens, min(num_prefix, num_tokens), chunk_tokens)
    handoffs = [handoff] * (len(stages) - 1)
    total = pipeline_seconds(stages, bounds, handoffs)
    work = [sum(stage.predict(e, b) for b, e in bounds) for stage in stages]
    assert total >= max(work) - 1e-9
    assert total <= sum(work) + handoff * len(handoffs) * len(bounds) + 1e-9
    first_chunk = sum(stage.predict(bounds[0][1], bounds[0][0]) for stage in stages) + sum(handoffs)
    assert total >= first_chunk - 1e-9


def _view(name: str, store: str, pipeline: PipelineSpec | None = None, queued_s: float = 0.0) -> PrefillInstanceView:
    return PrefillInstanceView(name, store, queued_prefill_s=queued_s, pipeline=pipeline)


GROUP = PipelineSpec((HALF.coefficients, HALF.coefficients), chunk_tokens=500, handoff_s=(0.01,))
POLICY = SchedulerPolicy(PolicyConfig(block_size=1000, ttft_slo_s=30.0, cpp_min_tokens=4000),
                         Predictors(LINEAR, DecodeStepPredictor((0.01, 0.0, 0.0)), TransferTimePredictor(1, 1e9)))
DECODES = [DecodeInstanceView("d0", "sd", 0, 0, 64, 1_000_000)]


def test_long_prompts_go_to_a_group_when_it_predicts_the_lower_ttft() -> None:
    views = [_view("p0", "s0"), _view("g0", "sg", GROUP)]
    long = schedule(RequestInfo("r1", 10_000, ()), views, DECODES, ShadowIndex(), POLICY, now=0.0)
    # single: 10 s; group: 20 chunks of 0.25 s on each stage, stage 1 one chunk + handoff behind: 5.26 s
    assert isinstance(long, Placement) and long.prefill_instance == "g0"
    assert long.predicted_prefill_s == pytest.approx(5.26)
    short = schedule(RequestInfo("r2", 3000, ()), views, DECODES, ShadowIndex(), POLICY, now=0.0)
    assert isinstance(short, Placement) and short.prefill_instance == "p0"  # not longer than cpp_min_tokens
    busy = [_view("p0", "s0"), _view("g0", "sg", GROUP, queued_s=6.0)]
    queued = schedule(RequestInfo("r3", 10_000, ()), busy, DECODES, ShadowIndex(), POLICY, now=0.0)
    assert isinstance(queued, Placement) and queued.prefill_instance == "p0"  # the group's queue: 11.26 s > 10 s


def test_short_prompts_use_a_group_only_without_a_single_instance() -> None:
    request = RequestInfo("r1", 100, ())
    group = _view("g0", "sg", GROUP)
    assert eligible_prefill(request, [_view("p0", "s0"), group], POLICY.config) == [_view("p0", "s0")]
    assert eligible_prefill(request, [group], POLICY.config) == [group]
    down = PrefillInstanceView("p0", "s0", is_available=False)
    assert eligible_prefill(request, [down, group], POLICY.config) == [group]


def test_a_pipeline_spec_is_checked() -> None:
    with pytest.raises(ValueError, match="2 stages"):
        PipelineSpec((HALF.coefficients,), chunk_tokens=10)
    with pytest.raises(ValueError, match="chunk_tokens"):
        PipelineSpec((HALF.coefficients, HALF.coefficients), chunk_tokens=0)
    with pytest.raises(ValueError, match="6 coefficients"):
        PipelineSpec(((1.0,), HALF.coefficients), chunk_tokens=10)
    with pytest.raises(ValueError, match="cpp_min_tokens"):
        PolicyConfig(cpp_min_tokens=-1)
