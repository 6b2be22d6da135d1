"""Simulator: determinism, cache study vs the trace ceiling, config validation, the CLI modes."""

import argparse
import math
import json
import random

import pytest

from mooncaked.sim import cli
from mooncaked.sim.cache_study import run_cache_study
from mooncaked.sim.config import SimConfig, SimConfigError, parse_sim_config, with_overrides
from mooncaked.sim.engine import Simulator
from mooncaked.sim.results import tbt_of
from mooncaked.sim.trace import TraceError, TraceRequest, load_trace


def _write_trace(path, num_requests=240, seed=7):
    """Multi-turn sessions: each turn extends its session's previous prompt, so ids repeat as prefixes."""
    rng = random.Random(seed)
    sessions: list[list[int]] = []
    next_id = 0
    lines = []
    for i in range(num_requests):
        if sessions and rng.random() < 0.6:
            history = rng.choice(sessions)
        else:
            history = []
            sessions.append(history)
        num_new = rng.randint(1, 12)
        history.extend(range(next_id, next_id + num_new))
        next_id += num_new
        record = {"timestamp": i * 150, "input_length": len(history) * 512 - rng.randint(0, 400),
                  "output_length": rng.randint(1, 60), "hash_ids": list(history)}
        lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n")
    return path


def _ceiling(path):
    seen, hits, total = set(), 0, 0
    for line in path.read_text().splitlines():
        ids = json.loads(line)["hash_ids"]
        hits += sum(1 for h in ids if h in seen)
        total += len(ids)
        seen.update(ids)
    return hits / total


def _small_config(**scheduler):
    config = with_overrides(SimConfig(), "cluster", num_prefill=3, num_decode=2, dram_blocks_per_host=300)
    return with_overrides(config, "scheduler", **scheduler) if scheduler else config


def test_simulation_is_deterministic(tmp_path):
    trace = _write_trace(tmp_path / "t.jsonl")
    config = with_overrides(_small_config(admission="early_rejection_predicted"), "run", prefill_noise=0.2, seed=3)
    first = Simulator(config, load_trace(trace)).run()
    second = Simulator(config, load_trace(trace)).run()
    assert [vars(r) for r in first.records] == [vars(r) for r in second.records]
    assert first.samples == second.samples
    served = [r for r in first.records if not r.rejection_reason]
    assert served and all(r.ttft_s > 0 for r in served)
    assert any(r.prefix_blocks > 0 for r in served)


def test_unbounded_cache_study_hits_the_trace_ceiling(tmp_path):
    trace = _write_trace(tmp_path / "t.jsonl")
    result = run_cache_study(load_trace(trace), ["lru", "lfu", "length_aware"], [50, None])
    ceiling = _ceiling(trace)
    assert result["ceiling"] == pytest.approx(ceiling)
    for policy in ("lru", "lfu", "length_aware"):
        assert result["hit_rate"][policy]["inf"] == pytest.approx(ceiling)
        assert result["hit_rate"][policy]["50"] < ceiling


def test_single_prefill_with_unbounded_store_reuses_up_to_the_ceiling(tmp_path):
    trace = _write_trace(tmp_path / "t.jsonl")
    config = with_overrides(SimConfig(), "cluster", num_prefill=1, num_decode=1, dram_blocks_per_host=10**9)
    config = with_overrides(config, "scheduler", admission="none")
    result = Simulator(config, load_trace(trace)).run()
    reused = sum(r.prefix_blocks for r in result.records)
    total = sum(r.num_blocks for r in result.records)
    # One FIFO instance: every earlier turn has committed before a later one starts, so reuse is the ceiling.
    assert reused / total == pytest.approx(_ceiling(trace))


def test_tbt_is_mean_of_longest_tenth():
    assert tbt_of([0.01] * 18 + [0.5, 0.3]) == pytest.approx(0.4)
    assert tbt_of([0.02, 0.9]) == pytest.approx(0.9)
    assert tbt_of([]) == 0.0


def test_config_errors_name_the_key():
    with pytest.raises(SimConfigError, match="cluster.num_prefill"):
        parse_sim_config({"cluster": {"num_prefill": "x"}})
    with pytest.raises(SimConfigError, match="cluster.bogus"):
        parse_sim_config({"cluster": {"bogus": 1}})
    with pytest.raises(SimConfigError, match="cluster.eviction"):
        parse_sim_config({"cluster": {"eviction": "fifo"}})
    with pytest.raises(SimConfigError, match="scheduler"):
        parse_sim_config({"scheduler": {"admission": "maybe"}})
    assert parse_sim_config({"run": {"speed": 2}}).run.speed == 2.0
    with pytest.raises(SimConfigError, match="replication must be one of always, by_reuse"):
        parse_sim_config({"scheduler": {"replication": "sometimes"}})
    with pytest.raises(SimConfigError, match="tie_break"):
        parse_sim_config({"scheduler": {"tie_break": "last"}})
    with pytest.raises(SimConfigError, match="replica_displaced_reuse"):
        parse_sim_config({"scheduler": {"replica_displaced_reuse": -1.0}})
    base = with_overrides(SimConfig(), "cluster", num_prefill=10)
    layered = parse_sim_config({"scheduler": {"replication": "by_reuse"}}, base)  # keys left out keep the base's
    assert layered.cluster.num_prefill == 10 and layered.scheduler.replication == "by_reuse"


def test_trace_errors_name_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 1}\n')
    with pytest.raises(TraceError, match="line 2"):
        load_trace(bad)


def test_cli_run_and_cache_modes(tmp_path, capsys):
    trace = _write_trace(tmp_path / "t.jsonl", num_requests=80)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    out = tmp_path / "sim.json"
    args = parser.parse_args(["--trace", str(trace), "--json", str(out), "--no-progress",
                              "--set", "cluster.num_prefill=2", "--set", "cluster.num_decode=2",
                              "--plots", str(tmp_path / "plots")])
    assert cli.run(args) == 0
    data = json.loads(out.read_text())
    assert data["summary"]["num_requests"] == 80 and "sim_seconds" in data["summary"]
    assert (tmp_path / "plots" / "latency_cdf.png").exists()
    cache_out = tmp_path / "cache.json"
    args = parser.parse_args(["cache", "--trace", str(trace), "--capacities", "10,inf", "--policies", "lru",
                              "--json", str(cache_out), "--no-progress"])
    assert cli.run(args) == 0
    cache = json.loads(cache_out.read_text())
    assert cache["hit_rate"]["lru"]["inf"] == pytest.approx(cache["ceiling"])
    bad = parser.parse_args(["--trace", str(trace), "--set", "cluster.num_prefill=zero", "--no-progress"])
    assert cli.run(bad) == 2
    assert "cluster.num_prefill" in capsys.readouterr().err


def test_a_fetched_prefix_is_reused_even_where_the_store_has_no_room_for_it():
    """The instance reads fetched blocks into the request's pages and caches them only where there is room
    (roles/worker/kv_plan.py): a destination store full of leased blocks costs the replica, not the reuse."""
    config = with_overrides(_small_config(scheduler="kvcache_centric", replication="always"), "cluster",
                            num_prefill=2, dram_blocks_per_host=8)
    ahead = TraceRequest(0, 0.0, 12 * 512, 1, tuple(range(200, 212)))  # runs first: the fetch ends meanwhile
    request = TraceRequest(1, 0.001, 12 * 512, 1, tuple(range(12)))
    sim = Simulator(config, [ahead, request])
    source, destination = sim.store_by_id["p0"], sim.store_by_id["p1"]
    source.put(range(8), now=0.0)
    sim.prefill_by_id["prefill-0"].busy_until = 1e6  # the prefix's holder is busy: Algorithm 1 fetches it
    destination.put(range(100, 108), now=0.0)
    destination.cache.lock(range(100, 108))  # every block of the destination is leased by its queue
    record = sim.run().records[1]
    assert (record.prefill_instance, record.fetch_source, record.fetched_blocks) == ("prefill-1", "p0", 8)
    assert record.prefix_blocks == 8  # the whole fetched prefix, though none of it was stored
    assert all(key not in destination.cache for key in range(8))


def test_inline_prefill_on_decode_instances_serves_prompts_whose_prefix_they_hold(tmp_path):
    """`cluster.inline_prefill_max_tokens`: the simulator places through `sched.inline.place` as the conductor
    does; an inline request is prefilled by its decode instance's step and then decodes there."""
    trace = _write_trace(tmp_path / "t.jsonl")
    config = with_overrides(_small_config(admission="none"), "cluster", inline_prefill_max_tokens=6000)
    result = Simulator(config, load_trace(trace)).run()
    inline = [r for r in result.records if r.is_inline]
    assert inline and all(r.prefill_instance == r.decode_instance for r in inline)
    assert all(r.ttft_s > 0 and r.finished_s >= r.arrival_s + r.ttft_s for r in inline)
    assert all(not r.rejection_reason for r in result.records)
    default = Simulator(_small_config(admission="none"), load_trace(trace)).run()
    assert not any(r.is_inline for r in default.records)  # 0 (the simulator's default): never


def test_a_decode_instance_short_of_pages_refuses_reserve_or_makes_the_request_wait(tmp_path):
    """The decode role's RESERVE rule: prompt and output pages are set aside until the request ends; under early
    rejection a request without room now is refused (`decode_memory`), under `none` its RESERVE (and so its
    prefill) waits for room, in arrival order, up to the TTFT SLO; a request larger than the instance's whole KV
    is refused by both."""
    trace = _write_trace(tmp_path / "t.jsonl")
    tight = with_overrides(_small_config(admission="early_rejection"), "gpu", kv_memory_fraction=0.02)
    refusing = Simulator(tight, load_trace(trace))
    refused = refusing.run()
    assert any(r.rejection_reason == "decode_memory" for r in refused.records)
    waiting = Simulator(with_overrides(tight, "scheduler", admission="none"), load_trace(trace))
    waited = waiting.run()
    num_pages = waiting.decode[0].num_pages
    assert num_pages == refusing.decode[0].num_pages
    too_large = {r.index for r in waited.records if -(-(r.input_length + r.output_length) // 512) > num_pages}
    assert too_large <= {r.index for r in waited.records if r.rejection_reason == "decode_memory"}
    assert all(r.rejection_reason in ("", "decode_memory", "decode_queued") for r in waited.records)
    gave_up = [r for r in waited.records if r.rejection_reason and r.index not in too_large]
    assert all(not math.isnan(r.ttft_s) or r.rejection_reason for r in waited.records)
    assert sum(1 for r in waited.records if not r.rejection_reason) > sum(
        1 for r in refused.records if not r.rejection_reason)
    assert len(gave_up) < len(waited.records) // 2
    assert all(not d.reserved_pages and not d.reserve_queue for d in waiting.decode)  # every page given back


def test_the_example_config_loads():
    from pathlib import Path

    from mooncaked.sim.config import load_sim_config
    config = load_sim_config(Path(__file__).parents[2] / "sim.example.yaml")
    assert config.scheduler.max_decode_defer_s == 0.0 and config.model.num_layers == 80
