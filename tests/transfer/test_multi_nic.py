"""Multi-NIC TCP transfers in the test network (2 hosts x 2 NICs, tbf-rated links): a transfer striped over both
NIC pairs runs at about twice one NIC's rate; a NIC taken down mid-transfer loses nothing (the bytes are checked)
and carries slices again once it is back."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from mooncaked.bench.network_peer import format_nics
from mooncaked.bench.testnet import TestNet
from mooncaked.transfer import SegmentRef, TransferEngine, TransferOp, TransferRequest
from mooncaked.transfer.nics import Nic

RATE_MBIT = 200
MIB = 1 << 20
MakeNet = Callable[..., TestNet]


class Peer:
    """One network_peer process in a test-network host, spoken to by JSON lines."""

    def __init__(self, net: TestNet, host: int, args: list[str]) -> None:
        self.process = net.exec(host, [sys.executable, "-m", "mooncaked.bench.network_peer", *args],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line.encode() + b"\n")
        self.process.stdin.flush()

    def read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()  # bounded: the peer's transfers have their own deadlines
        assert line, f"peer exited with {self.process.wait(5)}"
        return dict(json.loads(line))

    def fetch(self, count: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        self.send(f"fetch {count}")
        transfers = [self.read() for _ in range(count)]
        return transfers, self.read()


def nics_of(net: TestNet, host: int, num_nics: int) -> str:
    return format_nics([(f"nic{k}", f"{net.nic_address(host, k)}/24") for k in range(num_nics)])


@pytest.fixture
def network(make_testnet: MakeNet) -> Iterator[tuple[TestNet, str, int]]:
    """Host 1 serves NUM_BYTES over both NICs; yields the network, the server's endpoint and the size."""
    net = make_testnet(2, 2, rate_mbit=RATE_MBIT)
    num_bytes = 24 * MIB
    server = Peer(net, 1, ["serve", "--host", net.nic_address(1, 0), "--nics", nics_of(net, 1, 2),
                           "--bytes", str(num_bytes)])
    endpoint = server.read()["endpoint"]
    yield net, endpoint, num_bytes


def client(net: TestNet, endpoint: str, num_bytes: int, num_nics: int) -> Peer:
    peer = Peer(net, 0, ["fetch", "--host", net.nic_address(0, 0), "--nics", nics_of(net, 0, num_nics),
                         "--endpoint", endpoint, "--bytes", str(num_bytes)])
    assert peer.read() == {"ready": True}
    return peer


def tx_bytes(net: TestNet, host: int, nic: int) -> int:
    return int(net.run(host, ["cat", f"/sys/class/net/nic{nic}/statistics/tx_bytes"]))


def seconds(transfer: dict[str, Any]) -> float:
    assert transfer["is_intact"], transfer
    return float(transfer["end"] - transfer["start"])


def test_two_nics_carry_about_twice_one_nics_rate(network: tuple[TestNet, str, int]) -> None:
    net, endpoint, num_bytes = network
    one = client(net, endpoint, num_bytes, num_nics=1)
    (one_nic,), _ = one.fetch(1)
    two = client(net, endpoint, num_bytes, num_nics=2)
    before = [tx_bytes(net, 1, nic) for nic in range(2)]
    (two_nics,), done = two.fetch(1)
    sent = [tx_bytes(net, 1, nic) - before[nic] for nic in range(2)]
    assert min(sent) > 0.4 * num_bytes, f"bytes per server NIC {sent}: not striped over both"
    ratio = seconds(one_nic) / seconds(two_nics)
    assert ratio > 1.6, f"2 NICs {seconds(two_nics):.2f}s against 1 NIC {seconds(one_nic):.2f}s"
    assert len(done["path_states"]) == 4 and all(done["path_states"].values())


def test_a_nic_down_mid_transfer_loses_nothing_and_is_used_again_once_back(
        network: tuple[TestNet, str, int]) -> None:
    net, endpoint, num_bytes = network
    peer = client(net, endpoint, num_bytes, num_nics=2)
    start = tx_bytes(net, 1, 1)
    peer.send("fetch 1")
    deadline = time.monotonic() + 10
    while tx_bytes(net, 1, 1) - start < 2 * MIB:  # the transfer is under way on NIC 1
        assert time.monotonic() < deadline, "no bytes over NIC 1"
    net.set_link(1, 1, is_up=False)
    transfer, done = peer.read(), peer.read()
    assert transfer["is_intact"], transfer
    assert not all(done["path_states"].values()), "the failed NIC pair is cooling down"
    net.set_link(1, 1, is_up=True)
    time.sleep(1.0)  # the pair's cooldown (network_peer's --cooldown-s): it may be tried again after it
    before = tx_bytes(net, 1, 1)
    (after,), done = peer.fetch(1)
    assert seconds(after) > 0
    assert tx_bytes(net, 1, 1) - before > 0.3 * num_bytes, "the NIC that came back carries no slices"
    assert all(done["path_states"].values())


async def test_an_engine_listens_on_every_nic_and_its_peers_learn_them_in_the_handshake() -> None:
    """On loopback (no root needed): NICs without a prefix reach every peer NIC, so 2 x 2 NICs make 4 pairs."""
    server = TransferEngine(host="127.0.0.11", nics=[Nic.parse("a", "127.0.0.11"), Nic.parse("b", "127.0.0.12")])
    client_engine = TransferEngine(host="127.0.0.21", num_connections_per_peer=4,
                                   nics=[Nic.parse("c", "127.0.0.21"), Nic.parse("d", "127.0.0.22")])
    await server.start()
    await client_engine.start()
    try:
        src = np.random.default_rng(1).integers(0, 256, 8 * MIB, dtype=np.uint8)
        dst = np.zeros_like(src)
        server.register("src", src)
        client_engine.register("dst", dst)
        remote = SegmentRef(server.endpoint, "src")
        await client_engine.wait(client_engine.submit([TransferRequest(TransferOp.READ, "dst", 0, remote, 0,
                                                                       src.nbytes)]), timeout_s=20)
        assert np.array_equal(dst, src)
        states = client_engine.path_states(server.endpoint)
        pairs = {path.split("@")[1].split("#")[0] for path in states}
        assert pairs == {"c>a", "c>b", "d>a", "d>b"} and all(states.values())
    finally:
        await client_engine.stop()
        await server.stop()
