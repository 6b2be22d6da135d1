"""The test network: hosts in namespaces reach each other over each rail, at the links' rate; a link taken down
cuts only its NIC; everything made (namespaces, links, processes) is gone after `down()`, also of dead runs."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest

from mooncaked.bench import testnet
from mooncaked.bench.testnet import TestNet

SINK = """
import socket, sys
server = socket.create_server((sys.argv[1], 9000))
print("ready", flush=True)
while True:
    conn, _ = server.accept()
    while conn.recv(1 << 20):
        pass
    conn.sendall(b"done")
    conn.close()
"""
SEND = """
import socket, sys, time
sock = socket.create_connection((sys.argv[1], 9000), timeout=float(sys.argv[3]))
started = time.monotonic()
sock.sendall(bytes(int(sys.argv[2])))
sock.shutdown(socket.SHUT_WR)
assert sock.recv(4) == b"done"
print(time.monotonic() - started)
"""
MakeNet = Callable[..., TestNet]


def start_sink(net: TestNet, host: int, address: str) -> subprocess.Popen[bytes]:
    sink = net.exec(host, [sys.executable, "-c", SINK, address], stdout=subprocess.PIPE)
    assert sink.stdout is not None and sink.stdout.readline() == b"ready\n"
    return sink


def send_s(net: TestNet, host: int, address: str, num_bytes: int, timeout_s: float = 5.0) -> float:
    return float(net.run(host, [sys.executable, "-c", SEND, address, str(num_bytes), str(timeout_s)]))


def test_hosts_reach_each_other_on_every_rail_at_the_link_rate(make_testnet: MakeNet) -> None:
    net = make_testnet(2, 2, rate_mbit=40)
    for nic in range(2):
        start_sink(net, 1, net.nic_address(1, nic))
    num_bytes = 1 << 20  # 8.4 Mbit: 0.21 s at 40 mbit, a few ms unlimited
    for nic in range(2):
        elapsed_s = send_s(net, 0, net.nic_address(1, nic), num_bytes)
        assert 0.15 < elapsed_s < 1.0, f"rail {nic}: {elapsed_s:.3f}s for 1 MiB at 40 mbit"
    net.set_rate(0, 1, None)
    net.set_rate(1, 1, None)
    assert send_s(net, 0, net.nic_address(1, 1), num_bytes) < 0.1, "rate limit lifted"


def test_a_link_taken_down_cuts_only_its_nic_and_comes_back(make_testnet: MakeNet) -> None:
    net = make_testnet(2, 2)
    for nic in range(2):
        start_sink(net, 1, net.nic_address(1, nic))
    net.set_link(1, 0, is_up=False)
    with pytest.raises(testnet.TestNetError, match="(timed out|unreachable|No route)"):
        send_s(net, 0, net.nic_address(1, 0), 1000, timeout_s=0.5)
    send_s(net, 0, net.nic_address(1, 1), 1000)
    net.set_link(1, 0, is_up=True)
    send_s(net, 0, net.nic_address(1, 0), 1000, timeout_s=3.0)


def test_down_removes_namespaces_and_processes_and_leftovers_of_dead_runs(make_testnet: MakeNet) -> None:
    net = make_testnet(2, 1)
    names = {net.switch, net.namespace(0), net.namespace(1)}
    assert names <= set(testnet.list_namespaces())
    sleeper = net.exec(0, ["sleep", "60"])
    net.down()
    assert sleeper.poll() is not None, "a process exec'd in the network outlived it"
    assert not names & set(testnet.list_namespaces())
    dead_pid = _dead_pid()
    leftover = f"{testnet.DEFAULT_PREFIX}-{dead_pid}-abcdef-h0"
    subprocess.run(["ip", "netns", "add", leftover], check=True)
    try:
        assert leftover in testnet.clean_leftovers()
    finally:
        subprocess.run(["ip", "netns", "del", leftover], capture_output=True, check=False)
    assert leftover not in testnet.list_namespaces()


def _dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()  # reaped: its pid is free (a reuse within microseconds would need 4 million forks)
    return process.pid
