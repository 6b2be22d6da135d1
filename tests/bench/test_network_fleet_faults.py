"""Network faults under one elastic cluster on a test network (mooncaked/bench/network_fleet.py: 4 hosts of 2
NICs, host 1 at a tenth of the others' rate, etcd on rail 1), shared by the module's tests; the rounds are
`bench network --cluster`'s (mooncaked/bench/network_fleet_faults.py):

(b) one NIC of two down during a large prefix load between hosts: the load completes on the other NIC with the
    right first token, and every block it committed is whole (a later prefill reuses all of them);
(c) a slow link: after one measured fetch over it, the conductor recomputes a prefix held only behind it where
    Algorithm 1's line 5 would fetch it (sched/prefix_plans.py);
(e) etcd cut off from the leading conductor: it stops leading within the lease TTL, the other takes over, never
    two leaders at once, both keep serving within their deadlines, and the fleet view converges after the heal.
(a) and (d) are the process cluster's rounds (bench/network_cluster.py, tests/bench/test_network_cluster.py) and
tests/roles/test_store_gray_failure.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mooncaked.bench import testnet
from mooncaked.bench.etcd_server import MISSING_REASON, etcd_binary
from mooncaked.bench.network_fleet import FAST_MBIT, LEASE_TTL_S, NetworkFleet
from mooncaked.bench.network_fleet_faults import NUM_BLOCKS, etcd_cut, nic_down_during_loads, slow_link_placement

NO_FAULT = {"failed": 0, "lost": 0, "hung": 0}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetworkFleet]:
    reason = testnet.unavailable_reason() or ("" if etcd_binary() else MISSING_REASON)
    if reason:
        pytest.skip(reason)
    started = NetworkFleet(tmp_path_factory.mktemp("netfaults")).up()
    try:
        yield started
    finally:
        started.down()
    assert started.net.run_id not in " ".join(testnet.list_namespaces())


def test_a_nic_down_during_a_large_prefix_load_loses_nothing(fleet: NetworkFleet) -> None:
    # 60-block loads of about a second each over host 1's slow links; its NIC 1 down from 0.3 s for 1.5 s (less
    # than the lease TTL: host 1 reaches etcd over NIC 1 too)
    result = nic_down_during_loads(fleet, num_loads=3, down_after_s=0.3, down_s=1.5)
    assert {key: result[key] for key in NO_FAULT} == NO_FAULT, result
    # completed: all 60 blocks fetched, the reference token, and a prefill on host 0 reuses every block after it
    assert result["completed"] == result["requests"] >= 3, result
    assert result["migrated"] >= 1, f"no load was in flight while the NIC was down: {result}"
    assert result["nic1_failed_seen"], "p0's paths over NIC 1 never failed while NIC 0's carried the load"
    assert result["recovery_s"] is not None and result["recovery_s"] < 5.0, result
    fleet.wait_converged(LEASE_TTL_S + 5.0)


def test_a_slow_link_is_measured_and_its_prefix_recomputed(fleet: NetworkFleet) -> None:
    result = slow_link_placement(fleet, num_requests=3)
    assert {key: result[key] for key in NO_FAULT} == NO_FAULT and result["completed"] == 3, result
    fast_pair_bytes_per_s = 2 * FAST_MBIT * 1e6 / 8  # both NICs of two fast hosts
    assert result["measured_bytes_per_s"] < 0.5 * fast_pair_bytes_per_s < result["configured_bytes_per_s"]
    # line 5 fetches all 60 blocks over the slow link; each placement recomputes them on p0, faster than the
    # transfer alone (and p0's prefill model did not learn the loads over the slow link as compute)
    for placed in result["placements"]:
        assert placed["papers_source"] == "s1" and placed["papers_prefix_blocks"] == NUM_BLOCKS, placed
        assert placed["prefill_instance"] == "p0" and placed["fetch_from_store"] is None, placed
        assert placed["predicted_transfer_s"] == 0.0 and placed["predicted_ttft_s"] < placed["papers_transfer_s"]
    assert result["fetched_after_measure"] == 0 and result["computed_after_measure"] >= NUM_BLOCKS, result


def test_etcd_cut_off_from_the_leader_moves_leadership_without_overlap(fleet: NetworkFleet) -> None:
    result = etcd_cut(fleet, num_requests=1)
    assert {key: result[key] for key in NO_FAULT} == NO_FAULT and result["completed"] == 2, result
    assert not result["is_overlap"] and result["num_samples"] > 20, result
    assert result["stepped_down_s"] <= LEASE_TTL_S + 0.5, result  # the old leader's lease surely lapsed by then
    assert result["takeover_s"] <= LEASE_TTL_S + 4.0, result
    assert result["recovery_s"] is not None and result["recovery_s"] <= LEASE_TTL_S + 3.0, result
