"""Multi-NIC TCP transfers in the test network (2 hosts x 2 NICs, tbf-rated links): a transfer striped over both
NIC pairs runs at about twice one NIC's rate; a NIC taken down mid-transfer loses nothing (the bytes are checked)
and carries slices again once it is back."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from mooncaked.bench.network_driver import seconds, start_client, start_server, tx_bytes
from mooncaked.bench.testnet import TestNet
from mooncaked.transfer import SegmentRef, TransferEngine, TransferOp, TransferRequest
from mooncaked.transfer.nics import Nic

RATE_MBIT = 200
MIB = 1 << 20
MakeNet = Callable[..., TestNet]


@pytest.fixture
def network(make_testnet: MakeNet) -> Iterator[tuple[TestNet, str, int]]:
    """Host 1 serves NUM_BYTES over both NICs; yields the network, the server's endpoint and the size."""
    net = make_testnet(2, 2, rate_mbit=RATE_MBIT)
    num_bytes = 24 * MIB
    _, endpoint = start_server(net, 1, num_bytes)
    yield net, endpoint, num_bytes


def intact_seconds(transfer: dict[str, Any]) -> float:
    assert transfer["is_intact"], transfer
    return seconds(transfer)


def test_two_nics_carry_about_twice_one_nics_rate(network: tuple[TestNet, str, int]) -> None:
    net, endpoint, num_bytes = network
    one = start_client(net, 0, endpoint, num_bytes, num_nics=1)
    (one_nic,), _ = one.fetch(1)
    two = start_client(net, 0, endpoint, num_bytes, num_nics=2)
    before = [tx_bytes(net, 1, nic) for nic in range(2)]
    (two_nics,), done = two.fetch(1)
    sent = [tx_bytes(net, 1, nic) - before[nic] for nic in range(2)]
    assert min(sent) > 0.4 * num_bytes, f"bytes per server NIC {sent}: not striped over both"
    ratio = intact_seconds(one_nic) / intact_seconds(two_nics)
    assert ratio > 1.6, f"2 NICs {seconds(two_nics):.2f}s against 1 NIC {seconds(one_nic):.2f}s"
    assert len(done["path_states"]) == 4 and all(done["path_states"].values())


def test_a_nic_down_mid_transfer_loses_nothing_and_is_used_again_once_back(
        network: tuple[TestNet, str, int]) -> None:
    net, endpoint, num_bytes = network
    peer = start_client(net, 0, endpoint, num_bytes, num_nics=2)
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
    assert intact_seconds(after) > 0
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
