"""A short run of `mooncaked bench network` in a test network: 2 NICs beat 1, a NIC down and a partition lose
and hang nothing, and the rate buckets spread each transfer's bytes over its time."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from mooncaked.bench import testnet
from mooncaked.bench.network import rate_buckets, table, window_mean
from mooncaked.bench.network_cluster import summarize
from mooncaked.cli import main


def test_rate_buckets_spread_bytes_over_each_transfers_time() -> None:
    transfers = [{"start": 10.0, "end": 11.0, "bytes": 1_000_000}, {"start": 10.5, "end": 11.0, "bytes": 500_000}]
    assert rate_buckets(transfers, 10.0, 11.0, 0.5) == pytest.approx([8.0, 16.0])
    assert window_mean([4.0, 12.0, 6.0], 0.5, 1.5, 0.5) == 9.0
    assert window_mean([4.0], 1.0, 2.0, 0.5) is None


def test_network_bench_smoke(tmp_path: Path) -> None:
    reason = testnet.unavailable_reason()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "network.json"
    assert main(["bench", "network", "--rate-mbit", "200", "--mib", "8", "--repeats", "1", "--fault-mib", "2",
                 "--lead-s", "0.8", "--fault-s", "1.5", "--tail-s", "2.0",
                 "--io-timeout-s", "0.4", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["multi_nic_ratio"] > 1.5
    assert result["hung"] == 0 and result["lost"] == 0
    nic_down, partition = result["faults"]["nic_down"], result["faults"]["partition"]
    assert nic_down["failed"] == 0 and nic_down["completed"] == nic_down["requests"] > 0
    assert partition["completed_after_heal"] > 0, "transfers run again after the heal (tail 2 s, cooldown 1 s)"
    assert testnet.DEFAULT_PREFIX not in " ".join(testnet.list_namespaces()), "the bench left namespaces"


def test_a_cluster_round_counts_each_stream_once() -> None:
    args = argparse.Namespace(max_tokens=3)
    stream = {"text": "abc", "num_tokens": 3, "error": None, "start": 0.0, "end": 2.0, "is_hung": False}
    results = [stream, {**stream, "end": 3.0}, {**stream, "text": "abX"}, {**stream, "num_tokens": 2},
               {**stream, "error": "HTTP 429", "text": ""}, {**stream, "error": "no end", "is_hung": True}]
    summary = summarize(results, "abc", {"up_again_at": 12.5}, 10.0, 2.0, args)
    assert (summary["requests"], summary["completed"], summary["lost"], summary["failed"], summary["hung"]) == \
        (6, 2, 2, 1, 1)
    assert summary["migrated"] == 2 and summary["recovery_s"] == 2.5 and summary["errors"] == ["HTTP 429", "no end"]
    assert summarize([], "abc", {}, 10.0, 0.0, args)["recovery_s"] is None


def test_the_table_shows_the_fleets_rounds_by_their_counts() -> None:
    counts = {"requests": 4, "completed": 4, "failed": 0, "lost": 0, "hung": 0, "migrated": 2, "recovery_s": 0.4}
    result = {"rate_mbit": 100.0, "one_nic_mbit_s": [90.0], "two_nic_mbit_s": [180.0], "multi_nic_ratio": 2.0,
              "link_utilisation_2nic": 0.9, "cpu_share_2nic": {"client": 0.2}, "faults": {
                  "cluster_nic_down_load": {**counts, "nic1_failed_seen": True},
                  "cluster_etcd_cut": {**counts, "migrated": 0, "recovery_s": None, "takeover_s": 3.1}}}
    lines = table(result).splitlines()
    assert lines[-2] == ("cluster_nic_down_load: 4 requests, 4 completed, 0 failed, 0 lost, 0 hung, 2 migrated, "
                         "0.4 recovery_s; {'nic1_failed_seen': True}")
    assert lines[-1].startswith("cluster_etcd_cut: 4 requests") and "None recovery_s; {'takeover_s': 3.1}" in lines[-1]
