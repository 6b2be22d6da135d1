"""Prefill groups in the simulator: the pipeline time of a long prompt, which prompts go to a group, config
errors, and the simulator and the conductor placing a request on the same candidate for the same views."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncaked.roles.base import PeerClients
from mooncaked.roles.conductor.role import policy_config, view_settings
from mooncaked.roles.conductor.view.cluster import ClusterView
from mooncaked.roles.conductor.view.predictors import LivePredictors
from mooncaked.roles.worker.messages import LoadReply
from mooncaked.sched.algorithm import schedule
from mooncaked.sched.types import Placement, RequestInfo
from mooncaked.sim.config import SimConfig, SimConfigError, parse_sim_config, with_overrides
from mooncaked.sim.engine import Simulator
from mooncaked.sim.results import SimResult
from mooncaked.sim.trace import TraceRequest
from tests.roles.cluster_fixtures import cluster_config, instance

CHUNK = 1024


def group_config(num_prefill: int = 3, num_groups: int = 1, **scheduler: object) -> SimConfig:
    """`num_prefill` nodes, the last 2 x `num_groups` of them in 2-stage groups; admission none."""
    config = with_overrides(SimConfig(), "cluster", num_prefill=num_prefill, num_decode=1,
                            num_prefill_groups=num_groups, stages_per_group=2, cpp_chunk_tokens=CHUNK)
    return with_overrides(config, "scheduler", admission="none", **scheduler)


def linear(config: SimConfig) -> SimConfig:
    """A negligible attention term: every chunk of a prompt costs the same."""
    return with_overrides(config, "model", flops_a=1e-9)


def request(index: int, num_tokens: int, arrival_s: float = 0.0) -> TraceRequest:
    first_block = index * 1000  # no two requests share a block
    blocks = tuple(range(first_block, first_block + math.ceil(num_tokens / 512)))
    return TraceRequest(index, arrival_s, num_tokens, 1, blocks)


def run(config: SimConfig, requests: list[TraceRequest]) -> SimResult:
    return Simulator(config, requests).run()


def test_a_long_prompt_on_a_two_stage_group_takes_the_pipeline_time() -> None:
    config = linear(group_config())
    model, gpu, cluster = config.model, config.gpu, config.cluster
    per_token_s = model.num_layers * model.flops_b * model.hidden_size**2 / (gpu.flops * gpu.mfu)  # Eq. 1, linear
    stage_chunk_s = gpu.prefill_overhead_s + CHUNK * per_token_s / 2  # half the layers, one chunk
    handoff_s = cluster.link_latency_s + CHUNK * model.hidden_size * model.dtype_bytes / (
        cluster.link_bandwidth_gbps * 1e9 / 8)
    # 16 chunks: the fill (chunk 0 through stage 0, then the handoff), then stage 1 runs the 16 chunks back to back
    result = run(config, [request(0, 16 * CHUNK)])
    record = result.records[0]
    assert record.prefill_instance == "prefill-1" and record.is_pipelined
    assert record.ttft_s == pytest.approx(17 * stage_chunk_s + handoff_s, rel=1e-3)
    single_s = gpu.prefill_overhead_s + 16 * CHUNK * per_token_s
    assert run(linear(group_config(num_groups=0)), [request(0, 16 * CHUNK)]).records[0].ttft_s == pytest.approx(
        single_s, rel=1e-3)
    assert record.ttft_s < 0.8 * single_s
    # the group keeps both of its nodes busy: 2 of the 3 prefill nodes for the prefill's length
    sample = result.samples[0]
    assert sample.prefill_load == pytest.approx(2 * record.ttft_s / (config.run.sample_interval_s * 3))


@settings(max_examples=40, deadline=None)
@given(num_tokens=st.integers(1, 150_000))
def test_a_lone_request_takes_the_faster_of_the_group_and_a_single_instance(num_tokens: int) -> None:
    """Over cpp_min_tokens the request goes where it finishes first; at or under it, to the single instance."""
    single_s = run(group_config(num_prefill=1, num_groups=0), [request(0, num_tokens)]).records[0].ttft_s
    group_only = run(group_config(num_prefill=2), [request(0, num_tokens)]).records[0]
    assert group_only.is_pipelined  # no single instance: even a short prompt goes to the group
    mixed = run(group_config(), [request(0, num_tokens)]).records[0]
    is_long = num_tokens > SimConfig().scheduler.cpp_min_tokens
    assert mixed.is_pipelined == (is_long and group_only.ttft_s < single_s)
    assert mixed.ttft_s == pytest.approx(min(single_s, group_only.ttft_s) if is_long else single_s)


def test_short_prompts_queue_on_single_instances_unless_cpp_min_tokens_allows_the_group() -> None:
    burst = [request(i, 1500) for i in range(12)]  # all at once: the single instance queues them
    records = run(group_config(), burst).records
    assert all(r.prefill_instance == "prefill-0" and not r.is_pipelined for r in records)
    records = run(group_config(cpp_min_tokens=0), burst).records
    assert any(r.is_pipelined for r in records) and any(not r.is_pipelined for r in records)


def test_group_config_errors_name_the_key() -> None:
    with pytest.raises(SimConfigError, match="cluster.num_prefill_groups: 6 group nodes"):
        parse_sim_config({"cluster": {"num_prefill": 5, "num_prefill_groups": 3}})
    with pytest.raises(SimConfigError, match="cluster.stages_per_group"):
        parse_sim_config({"cluster": {"stages_per_group": 1, "num_prefill_groups": 1}})
    with pytest.raises(SimConfigError, match="cluster.num_prefill_groups"):
        parse_sim_config({"cluster": {"num_prefill_groups": -1}})
    with pytest.raises(SimConfigError, match="cluster.cpp_chunk_tokens"):
        parse_sim_config({"cluster": {"cpp_chunk_tokens": 0}})
    assert parse_sim_config({"scheduler": {"cpp_min_tokens": 0}}).scheduler.cpp_min_tokens == 0
    assert SimConfig().scheduler.cpp_min_tokens == 2048  # the conductor's default
    grouped = parse_sim_config({"cluster": {"num_prefill": 4, "num_prefill_groups": 2}})
    assert [p.instance_id for p in Simulator(grouped, []).prefill] == ["prefill-0", "prefill-2"]


@settings(max_examples=200, deadline=None)
@given(num_prefill=st.integers(-1, 12), num_groups=st.integers(-2, 8), num_stages=st.integers(-1, 6),
       chunk_tokens=st.one_of(st.integers(-5, 5000), st.text(max_size=3), st.floats()))
def test_any_group_config_builds_its_nodes_or_names_the_key(num_prefill: int, num_groups: int, num_stages: int,
                                                            chunk_tokens: object) -> None:
    cluster = {"num_prefill": num_prefill, "num_prefill_groups": num_groups, "stages_per_group": num_stages,
               "cpp_chunk_tokens": chunk_tokens}
    try:
        config = parse_sim_config({"cluster": cluster})
    except SimConfigError as exc:
        assert str(exc).startswith("cluster.")
        return
    prefill = Simulator(config, []).prefill
    assert sum(p.num_nodes for p in prefill) == num_prefill
    assert sum(1 for p in prefill if p.pipeline is not None) == num_groups
    assert all(p.pipeline.chunk_tokens == chunk_tokens for p in prefill if p.pipeline is not None)


def conductor_view(tmp_path: Path, sim: Simulator) -> ClusterView:
    """A conductor over p0 and the group g0 + g1 (a 1024-token chunk), predicting with the simulator's model."""
    config = cluster_config(
        tmp_path, [instance("p0", "prefill"), instance("g0", "prefill"), instance("g1", "prefill"),
                   instance("d0", "decode", settings={"inline_prefill_max_tokens": 0}), instance("c0", "conductor")],
        cluster={"prefill_groups": [{"name": "pg", "members": ["g0", "g1"]}]}, worker={"cpp_chunk_tokens": CHUNK},
        scheduler={"policy": "kvcache_centric", "admission": "none", "tie_break": "first",
                   "cpp_min_tokens": sim.config.scheduler.cpp_min_tokens})
    view = ClusterView(config, PeerClients(config, config.instance_named("c0")), policy_config(config),
                       LivePredictors(sim.costs.predictors), view_settings(config))
    for worker in view.workers:
        worker.is_up = True
        worker.load = LoadReply(role=worker.instance.role, num_running=0, num_waiting=0, num_queued_tokens=0,
                                num_free_pages=1 << 20, num_pages=1 << 20, step_time_s=0.0)
    return view


def test_the_simulator_and_the_conductor_place_alike(tmp_path: Path) -> None:
    """The same queues and models: the group's first stage reports the pipeline the simulator built."""
    sim = Simulator(group_config(), [])
    single, group = sim.prefill
    assert group.pipeline is not None
    view = conductor_view(tmp_path, sim)
    whole = list(sim.costs.predictors.prefill.coefficients)
    names = {"p0": single.instance_id, "g0": group.instance_id}

    @settings(max_examples=60, deadline=None)
    @given(num_tokens=st.integers(1, 150_000), single_queue_s=st.floats(0.0, 30.0),
           group_queue_s=st.floats(0.0, 30.0))
    def check(num_tokens: int, single_queue_s: float, group_queue_s: float) -> None:
        assert group.pipeline is not None
        single.queued_prefill_s, group.queued_prefill_s = single_queue_s, group_queue_s
        view.prefill["p0"].load = LoadReply("prefill", 0, 0, 0, 0, 0, 0.0, prefill_coefficients=whole,
                                            pending_work_s=single_queue_s)
        view.prefill["g0"].load = LoadReply(
            "prefill", 0, 0, 0, 0, 0, 0.0, prefill_coefficients=whole, pending_work_s=group_queue_s,
            pipeline_stages=[list(c) for c in group.pipeline.stage_coefficients],
            pipeline_handoffs_s=list(group.pipeline.handoff_s), cpp_chunk_tokens=group.pipeline.chunk_tokens)
        info = RequestInfo("r", num_tokens, ())
        simulated = schedule(info, [p.view() for p in sim.prefill], [d.view(False) for d in sim.decode],
                             sim.index, sim.policy, 0.0)
        conducted = view.place(info, 0.0)
        assert isinstance(simulated, Placement) and isinstance(conducted, Placement)
        assert names[conducted.prefill_instance] == simulated.prefill_instance
        assert conducted.predicted_prefill_s == pytest.approx(simulated.predicted_prefill_s)
        assert conducted.predicted_ttft_s == pytest.approx(simulated.predicted_ttft_s)

    check()
