"""Faults (a) and (d) of the test network under a process cluster (mooncaked/bench/network_cluster.py: 3 hosts of
2 NICs, every role its own process inside its host): the decode host running most streams partitioned mid-stream
then healed, and that decode process SIGSTOPped (sockets open, nothing answers) then continued. Every stream
completes with the undisturbed text (the stopped or cut-off instance's streams by migration), none fails or hangs,
the fleet view shows every member up again soon after the heal, and the test leaves no namespace behind."""

from __future__ import annotations

import argparse

import pytest

from mooncaked.bench import testnet
from mooncaked.bench.network_cluster import run_faults


def test_a_partitioned_and_a_stopped_decode_instance_lose_and_hang_nothing() -> None:
    reason = testnet.unavailable_reason()
    if reason:
        pytest.skip(reason)
    # The victim is the decode instance the conductor's LOAD polls (every 0.2 s) see running the streams, so a stream
    # must outlast a few polls after its first chunks: 300 tokens of random:tiny ended in 0.5 s on a quiet machine,
    # once before any poll counted them (no victim ran a stream); 900 (the bench's default) take ~1.5 s.
    args = argparse.Namespace(rate_mbit=100.0, streams=4, max_tokens=900, partition_s=3.0, stream_timeout_s=60.0,
                              start_timeout_s=120.0)
    faults = run_faults(args)
    assert set(faults) == {"cluster_partition", "cluster_sigstop"}
    for name, fault in faults.items():
        assert fault["requests"] == fault["completed"] == 4, (name, fault)
        assert fault["lost"] == fault["failed"] == fault["hung"] == 0, (name, fault)
        assert fault["migrated"] >= fault["running_at_fault"][fault["victim"]] >= 1, (name, fault)
        assert fault["recovery_s"] is not None and fault["recovery_s"] <= 15.0, (name, fault)
    assert testnet.DEFAULT_PREFIX not in " ".join(testnet.list_namespaces()), "the cluster left namespaces"
