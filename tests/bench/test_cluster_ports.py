"""Ports handed to local clusters: free, never twice in one process, and below the kernel's ephemeral range, so no
outgoing connection or port-0 bind started meanwhile (a tensor-parallel rendezvous, gloo) can take one before
its instance binds it."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from mooncaked.bench import cluster
from mooncaked.bench.cluster import ephemeral_range, free_port


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    first, _ = ephemeral_range()
    ports = [free_port("127.0.0.1") for _ in range(200)]
    assert len(set(ports)) == len(ports) and all(1024 <= p < first for p in ports)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[-1]))


def test_a_kernel_range_that_leaves_no_room_below_hands_out_ports_above(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "range").write_text("1025\t40000\n")
    monkeypatch.setattr(cluster, "EPHEMERAL_RANGE_FILE", tmp_path / "range")
    assert ephemeral_range() == (1025, 40000) and 40000 < free_port() <= 65535
    monkeypatch.setattr(cluster, "EPHEMERAL_RANGE_FILE", tmp_path / "missing")
    assert ephemeral_range() == (32768, 60999)
