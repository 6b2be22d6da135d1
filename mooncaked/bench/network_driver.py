"""Driving network_peer.py processes in a test network: start a server or a client in a host, ask for fetches,
read their JSON lines, and read the counters that tell whether links or CPUs bind (NIC bytes, process CPU time)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from mooncaked.bench.network_peer import format_nics
from mooncaked.bench.testnet import TestNet

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class PeerProcess:
    """One network_peer (or network_load) process in a test-network host (the network's `down()` kills it),
    spoken to by JSON lines."""

    def __init__(self, net: TestNet, host: int, args: list[str], module: str = "mooncaked.bench.network_peer") -> None:
        self.process = net.exec(host, [sys.executable, "-m", module, *args],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line.encode() + b"\n")
        self.process.stdin.flush()

    def read(self) -> dict[str, Any]:
        """The next JSON line; bounded by the peer's own deadlines (each transfer has `--timeout-s`)."""
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"network peer exited with {self.process.wait(5)} (its stderr has why)")
        return dict(json.loads(line))

    def fetch(self, count: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """`count` transfers in a row: their records, and the closing {"done", "path_states"}."""
        self.send(f"fetch {count}")
        transfers = [self.read() for _ in range(count)]
        return transfers, self.read()

    def cpu_seconds(self) -> float:
        """User plus system CPU time of the process so far."""
        with open(f"/proc/{self.process.pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def nics_of(net: TestNet, host: int, num_nics: int) -> str:
    return format_nics([(f"nic{k}", f"{net.nic_address(host, k)}/24") for k in range(num_nics)])


def start_server(net: TestNet, host: int, num_bytes: int, extra: Sequence[str] = ()) -> tuple[PeerProcess, str]:
    """A server of `num_bytes` on every NIC of `host`; it and its endpoint (on NIC 0)."""
    server = PeerProcess(net, host, ["serve", "--host", net.nic_address(host, 0), "--nics",
                                     nics_of(net, host, net.num_nics), "--bytes", str(num_bytes), *extra])
    return server, str(server.read()["endpoint"])


def start_client(net: TestNet, host: int, endpoint: str, num_bytes: int, num_nics: int,
                 extra: Sequence[str] = ()) -> PeerProcess:
    client = PeerProcess(net, host, ["fetch", "--host", net.nic_address(host, 0), "--nics",
                                     nics_of(net, host, num_nics), "--endpoint", endpoint, "--bytes",
                                     str(num_bytes), *extra])
    ready = client.read()
    if ready != {"ready": True}:
        raise RuntimeError(f"network peer did not start: {ready}")
    return client


def tx_bytes(net: TestNet, host: int, nic: int) -> int:
    """Bytes NIC `nic` of `host` has sent."""
    return int(net.run(host, ["cat", f"/sys/class/net/nic{nic}/statistics/tx_bytes"]))


def seconds(transfer: dict[str, Any]) -> float:
    return float(transfer["end"] - transfer["start"])
