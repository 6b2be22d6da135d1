"""Pool study: the global pool against partitioned local caches and one ideal cache, on a generated trace."""

import argparse
import json
import random

import pytest

from mooncaked.sched.replicas import StoreMarks
from mooncaked.sched.shadow_index import ShadowIndex
from mooncaked.sim import cli
from mooncaked.sim.cluster import HostStore
from mooncaked.sim.config import SimConfig, with_overrides
from mooncaked.sim.pool_study import ROW_KEYS, run_pool_study, study_defaults

CAPACITIES = [200, 400, 800]


def _write_sessions_trace(path, num_requests=1000, seed=2, rate_per_s=1.6):
    """Multi-turn sessions in Mooncake's trace format: a new session has 4-30 prefix blocks; a later turn of one of
    the ~150 most recent sessions adds 1-2 blocks (60%) or 3-16; histories stop growing past 60 blocks."""
    rng = random.Random(seed)
    sessions: list[list[int]] = []
    next_id, now, lines = 0, 0.0, []
    for _ in range(num_requests):
        now += rng.expovariate(rate_per_s)
        history = sessions[-1 - min(int(rng.expovariate(1 / 150)), len(sessions) - 1)] if sessions else []
        if history and len(history) < 60 and rng.random() < 0.55:
            num_new = rng.randint(1, 2) if rng.random() < 0.6 else rng.randint(3, 16)
        else:
            history = []
            sessions.append(history)
            num_new = rng.randint(4, 30)
        history.extend(range(next_id, next_id + num_new))
        next_id += num_new
        lines.append(json.dumps({"timestamp": int(now * 1000), "input_length": len(history) * 512 - rng.randint(0, 400),
                                 "output_length": rng.randint(1, 60), "hash_ids": list(history)}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    return _write_sessions_trace(tmp_path_factory.mktemp("pool") / "sessions.jsonl")


@pytest.fixture(scope="module")
def study(trace):
    """`mooncaked sim pool-study` on 4 prefill nodes, through the CLI and its JSON."""
    out = trace.parent / "pool.json"
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["pool-study", "--trace", str(trace), "--blocks-per-node", "200,400,800",
                              "--speeds", "1,2", "--json", str(out), "--no-progress",
                              "--set", "cluster.num_prefill=4"])
    assert cli.run(args) == 0
    return json.loads(out.read_text())["rows"]


def test_rows_cover_every_capacity_and_speed(study, capsys):
    assert [(r["blocks_per_node"], r["speed"]) for r in study] == [(c, s) for c in CAPACITIES for s in (1.0, 2.0)]
    assert all(set(r) == set(ROW_KEYS) for r in study)
    assert all(0 < r["ideal_hit"] < 1 and r["sole_copy_evictions"] > 0 for r in study)  # capacity is tight


def test_global_pool_is_near_the_ideal_cache_at_1x_and_never_below_local(study):
    for row in study:
        assert row["global_hit"] >= row["local_hit"], row
        if row["speed"] == 1.0:
            assert row["global_hit"] >= 0.95 * row["ideal_hit"], row
        else:
            assert row["global_compute_s"] <= row["local_compute_s"], row


def test_replica_aware_pool_evicts_fewer_sole_copies_than_the_papers(trace):
    """The same study with every copy kept as a full replica (the paper's pool): more duplicates pushed out sole
    copies, and the pool falls further short of the ideal cache."""
    base = with_overrides(study_defaults(SimConfig()), "cluster", num_prefill=4)
    paper = with_overrides(base, "scheduler", replication="always")
    ours = run_pool_study(str(trace), base, [400], [1.0])["rows"][0]
    theirs = run_pool_study(str(trace), paper, [400], [1.0])["rows"][0]
    assert ours["sole_copy_evictions"] < theirs["sole_copy_evictions"]
    assert ours["duplicate_blocks"] < theirs["duplicate_blocks"]
    assert ours["global_hit"] > theirs["global_hit"]


def test_pool_study_flags_are_checked(trace, capsys):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    for flags in (["--blocks-per-node", "10,x"], ["--speeds", "0"], ["--blocks-per-node", "0"]):
        args = parser.parse_args(["pool-study", "--trace", str(trace), "--no-progress", *flags])
        assert cli.run(args) == 2
    assert "--blocks-per-node" in capsys.readouterr().err


def test_host_stores_count_sole_copy_evictions_and_spare_marks_apply():
    index = ShadowIndex()
    first, second = (HostStore(name, 2, "lru", index, is_replica_aware=True) for name in ("p0", "p1"))
    first.put([2, 1], now=0.0)  # least recently used first would take 2
    second.put([1], now=1.0)
    assert index.num_copies - index.num_keys == 1  # block 1 twice
    first.apply_marks(StoreMarks(spare=[1]))
    first.put([3], now=2.0)  # the spare copy of 1 goes instead: 2 is a sole copy
    assert 1 not in first.cache and 2 in first.cache
    assert (first.num_evicted, first.num_sole_copy_evictions) == (1, 0)
    second.put([4, 5], now=3.0)  # block 1's last copy goes
    assert (second.num_evicted, second.num_sole_copy_evictions) == (1, 1)
