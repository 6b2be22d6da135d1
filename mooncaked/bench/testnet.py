"""A test network on one machine: N hosts, each in its own network namespace with K NICs, on rate-limited links.

1. `TestNet(num_hosts, num_nics, rate_mbit)` with `up()` lays out one switch namespace holding one bridge per
   rail (`br<k>`) and, per host, a namespace whose NIC k (`nic<k>`) is one end of a veth pair whose other end
   (`h<h>n<k>`) is a port of bridge k. NIC k of host h has address 10.<net>.<k>.<h+1>/24 (`nic_address`): NIC k
   of every host is on rail k's subnet, as in a multi-rail cluster, so each NIC pair of two hosts on one rail has
   its own link and a NIC has one route. Nothing is added to the machine's own namespace; no address leaves the
   namespaces (each host's loopback is up too).
2. Rates: `set_rate(host, nic, mbit)` puts a `tc tbf` on both ends of the link (host -> switch on the NIC,
   switch -> host on the switch port); `up()` applies `rate_mbit` to every link (None: unlimited).
3. Faults: `set_link(host, nic, is_up)` takes the switch's port of that link down or up (the NIC sees its carrier
   go: a pulled cable; packets in flight are lost, sockets stay open); `partition(host)` / `heal(host)` do so for
   every NIC of a host.
4. `exec(host, argv)` starts a process inside a host's namespace (`ip netns exec`), in its own process group;
   `run(host, argv)` runs one to completion.
5. `down()` kills every process it started and every process still inside its namespaces, then deletes the
   namespaces (which deletes their links and qdiscs). Namespaces are named `<prefix>-<pid>-<token>-...`:
   `clean_leftovers(prefix)` deletes those of runs whose process is gone (a test run killed before its cleanup).

Needs root (CAP_NET_ADMIN) and `ip`/`tc`; `unavailable_reason()` says why not, for tests to skip with.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
from collections.abc import Sequence

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "mcn"
_COMMAND_TIMEOUT_S = 10.0
_KILL_TIMEOUT_S = 5.0


class TestNetError(RuntimeError):
    """A command laying out or changing the test network failed (its stderr is in the message)."""


def unavailable_reason() -> str:
    """"" when this process can make network namespaces, else why not (tests skip with it)."""
    if os.geteuid() != 0:
        return "the test network needs root (network namespaces, veth, tc)"
    probe = f"{DEFAULT_PREFIX}-probe-{os.getpid()}-{secrets.token_hex(2)}"
    try:
        _ip("netns", "add", probe)
    except (OSError, TestNetError) as exc:
        return f"cannot make a network namespace: {exc}"
    try:
        _ip("-n", probe, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1")
        _command(["tc", "-n", probe, "qdisc", "add", "dev", "probe0", "root", "tbf", "rate", "100mbit",
                  "burst", "128k", "latency", "50ms"])
    except (OSError, TestNetError) as exc:
        return f"cannot make veth links with tbf rates in a namespace: {exc}"
    finally:
        _ip("netns", "del", probe)
    return ""


def clean_leftovers(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Delete the namespaces (and so links) of earlier runs with `prefix` whose process is gone; their names."""
    removed = []
    for name in list_namespaces():
        owner = _owner_pid(name, prefix)
        if owner is not None and not os.path.exists(f"/proc/{owner}"):
            _kill_namespace_processes(name)
            _ip("netns", "del", name)
            removed.append(name)
    if removed:
        logger.info("removed %d namespaces of dead test-network runs: %s", len(removed), ", ".join(removed))
    return removed


def list_namespaces() -> list[str]:
    listing = _command(["ip", "netns", "list"])
    return [line.split()[0] for line in listing.splitlines() if line.strip()]


class TestNet:
    """Owns the namespaces of one run, and the processes `exec` started in them."""

    __test__ = False  # not a pytest test class

    def __init__(self, num_hosts: int, num_nics: int, rate_mbit: float | None = None, *,
                 prefix: str = DEFAULT_PREFIX, net: int = 77) -> None:
        if not 1 <= num_hosts <= 250 or not 1 <= num_nics <= 250:
            raise ValueError(f"1..250 hosts and NICs per host, got {num_hosts} hosts, {num_nics} NICs")
        if "-" in prefix or not prefix.isalnum():
            raise ValueError(f"prefix must be alphanumeric (no '-'), got {prefix!r}")
        self.num_hosts = num_hosts
        self.num_nics = num_nics
        self.rate_mbit = rate_mbit
        self.prefix = prefix
        self.run_id = f"{prefix}-{os.getpid()}-{secrets.token_hex(3)}"
        self._net = net
        self._processes: list[subprocess.Popen[bytes]] = []
        self._namespaces: list[str] = []

    @property
    def switch(self) -> str:
        return f"{self.run_id}-sw"

    def namespace(self, host: int) -> str:
        return f"{self.run_id}-h{host}"

    def nic_address(self, host: int, nic: int) -> str:
        return f"10.{self._net}.{nic}.{host + 1}"

    def up(self) -> TestNet:
        clean_leftovers(self.prefix)
        try:
            self._add_namespace(self.switch)
            for nic in range(self.num_nics):
                _ip("-n", self.switch, "link", "add", f"br{nic}", "type", "bridge")
                _ip("-n", self.switch, "link", "set", f"br{nic}", "up")
            for host in range(self.num_hosts):
                self._add_host(host)
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Kill what `exec` started and what still runs in the namespaces, then delete the namespaces."""
        for process in self._processes:
            _kill_group(process)
        self._processes.clear()
        for name in reversed(self._namespaces):
            _kill_namespace_processes(name)
            try:
                _ip("netns", "del", name)
            except TestNetError as exc:
                logger.warning("test network: %s", exc)
        self._namespaces.clear()

    def __enter__(self) -> TestNet:
        return self.up()

    def __exit__(self, *exc_info: object) -> None:
        self.down()

    def set_rate(self, host: int, nic: int, mbit: float | None) -> None:
        """Limit both directions of one link to `mbit` (None: no limit)."""
        for namespace, device in ((self.namespace(host), f"nic{nic}"), (self.switch, f"h{host}n{nic}")):
            if mbit is None:
                _command(["tc", "-n", namespace, "qdisc", "replace", "dev", device, "root", "pfifo_fast"])
                continue
            burst_bytes = max(int(mbit * 1e6 / 8 / 100), 128 << 10)  # 10 ms of the rate, and a whole GSO packet
            _command(["tc", "-n", namespace, "qdisc", "replace", "dev", device, "root", "tbf", "rate",
                      f"{mbit}mbit", "burst", str(burst_bytes), "latency", "50ms"])

    def set_link(self, host: int, nic: int, is_up: bool) -> None:
        """Take the switch's port of NIC `nic` of `host` down (a pulled cable) or back up."""
        _ip("-n", self.switch, "link", "set", f"h{host}n{nic}", "up" if is_up else "down")

    def partition(self, host: int) -> None:
        for nic in range(self.num_nics):
            self.set_link(host, nic, False)

    def heal(self, host: int) -> None:
        for nic in range(self.num_nics):
            self.set_link(host, nic, True)

    def exec(self, host: int, argv: Sequence[str], **popen_kwargs: object) -> subprocess.Popen[bytes]:
        """Start `argv` inside `host`'s namespace in a new process group; `down()` kills it."""
        process: subprocess.Popen[bytes] = subprocess.Popen(  # type: ignore[call-overload]
            ["ip", "netns", "exec", self.namespace(host), *argv], start_new_session=True, **popen_kwargs)
        self._processes.append(process)
        return process

    def run(self, host: int, argv: Sequence[str], timeout_s: float = _COMMAND_TIMEOUT_S) -> str:
        """Run `argv` in `host`'s namespace to completion; its stdout (TestNetError when it fails)."""
        return _command(["ip", "netns", "exec", self.namespace(host), *argv], timeout_s)

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._namespaces.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _add_host(self, host: int) -> None:
        namespace = self.namespace(host)
        self._add_namespace(namespace)
        for nic in range(self.num_nics):
            port = f"h{host}n{nic}"
            _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", f"nic{nic}",
                "netns", namespace)
            _ip("-n", self.switch, "link", "set", port, "master", f"br{nic}")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", namespace, "addr", "add", f"{self.nic_address(host, nic)}/24", "dev", f"nic{nic}")
            _ip("-n", namespace, "link", "set", f"nic{nic}", "up")
            if self.rate_mbit is not None:
                self.set_rate(host, nic, self.rate_mbit)


def _owner_pid(namespace: str, prefix: str) -> int | None:
    parts = namespace.split("-")
    if len(parts) >= 3 and parts[0] == prefix and parts[1].isdigit():
        return int(parts[1])
    return None


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        process.wait(_KILL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        logger.warning("test network: process %d did not end after SIGKILL", process.pid)


def _kill_namespace_processes(namespace: str) -> None:
    try:
        pids = [int(pid) for pid in _command(["ip", "netns", "pids", namespace]).split()]
    except TestNetError:
        return
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _ip(*args: str) -> str:
    return _command(["ip", *args])


def _command(argv: Sequence[str], timeout_s: float = _COMMAND_TIMEOUT_S) -> str:
    try:
        done = subprocess.run(list(argv), capture_output=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise TestNetError(f"{' '.join(argv)}: no answer within {timeout_s:g}s") from None
    if done.returncode != 0:
        raise TestNetError(f"{' '.join(argv)}: {done.stderr.decode(errors='replace').strip()}")
    return done.stdout.decode(errors="replace")
