"""One elastic cluster on a test network (mooncaked/bench/testnet.py), for its fault rounds
(network_fleet_faults.py: `bench network --cluster`, tests/bench/test_network_fleet_faults.py).

1. `NetworkFleet.up(tmp_path)` lays out 4 hosts of 2 NICs (rails 0 and 1), every link at `FAST_MBIT` except host
   1's, at a tenth of it (a slow host):
     host 0: etcd (listening on its rail-1 address only), store s0, prefill p0, decode d0
     host 1: store s1, prefill p1 (the slow host)
     host 2: conductor c0            host 3: conductor c1
   Every role runs in-process on its host's loop (bench/host_loops.py), with its own config naming only
   itself (`cluster.membership: etcd`); `transfer.nics` lists both NICs of every host, so KV crosses both rails.
   Instances are addressed on rail 0 and etcd on rail 1: a host's rail-1 link down cuts it off etcd only, and,
   for a conductor alone on its host, nothing else (fault e).
2. `up` returns once both conductors see every worker and store placeable (the fleet view has converged).
3. `down()` stops every role (all at once, each on its host's loop), closes the loops, kills etcd and deletes the
   namespaces, whatever failed before; `ip netns list` is then clean of this run.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import yaml

from mooncaked.bench import testnet
from mooncaked.bench.etcd_server import EtcdServer
from mooncaked.bench.host_loops import HostLoop
from mooncaked.config import load_config
from mooncaked.kv.keys import block_keys
from mooncaked.roles import make_role
from mooncaked.roles.base import PeerClients
from mooncaked.roles.conductor.leader import PdController
from mooncaked.roles.conductor.role import ConductorRole
from mooncaked.roles.member import MemberRole
from mooncaked.roles.worker.messages import PREFILL, PrefillReply, PrefillRequest
from mooncaked.runtime.lifecycle import Role

T = TypeVar("T")
logger = logging.getLogger(__name__)

FAST_MBIT = 24.0
SLOW_HOST = 1
ETCD_HOST = 0
LEASE_TTL_S = 3
# (name, role, host, port); a store's data port is its port + 1
INSTANCES = (("s0", "store", 0, 7100), ("s1", "store", 1, 7100), ("p0", "prefill", 0, 7200),
             ("p1", "prefill", 1, 7200), ("d0", "decode", 0, 7300), ("c0", "conductor", 2, 8000),
             ("c1", "conductor", 3, 8000))
WORKERS = ("s0", "s1", "p0", "p1", "d0")
_STOP_TIMEOUT_S = 30.0


class NetworkFleet:
    """Owns the test network, the host loops, etcd and the roles started on them."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.net = testnet.TestNet(4, 2, FAST_MBIT)
        self.hosts: list[HostLoop] = []
        self.etcd: EtcdServer | None = None
        self.roles: dict[str, Role] = {}

    @property
    def etcd_endpoint(self) -> str:
        return f"http://{self.net.nic_address(ETCD_HOST, 1)}:2379"

    def host_of(self, name: str) -> HostLoop:
        return self.hosts[next(host for n, _, host, _ in INSTANCES if n == name)]

    def url(self, conductor: str) -> str:
        host, port = next((host, port) for n, _, host, port in INSTANCES if n == conductor)
        return f"http://{self.net.nic_address(host, 0)}:{port}"

    def inner(self, name: str) -> Any:
        role = self.roles[name]
        return role.inner if isinstance(role, MemberRole) else role

    def conductor(self, name: str) -> ConductorRole:
        role = self.inner(name)
        assert isinstance(role, ConductorRole) and role.view is not None
        return role

    def controller(self, name: str) -> PdController:
        """Conductor `name`'s P/D controller: it leads (and may switch roles) only while its lease surely lives."""
        controller = self.conductor(name).controller
        assert controller is not None
        return controller

    def on(self, name: str, function: Callable[[], Awaitable[T]], timeout_s: float = 30.0) -> T:
        """Run `function()` on the loop of the host of instance `name`."""
        return self.host_of(name).call(function, timeout_s)

    def read(self, name: str, read: Callable[[], T]) -> T:
        """`read()` on the loop that owns instance `name` (its state is only consistent there)."""
        async def run() -> T:
            return read()
        return self.on(name, run, 5.0)

    def keys(self, tokens: list[int]) -> list[bytes]:
        """The prompt's block keys, as every instance of this fleet (one model, one block size) names them."""
        worker = self.inner("p0").worker
        return block_keys(tokens, worker.config.kv.block_size, worker.namespace)

    def prefill(self, name: str, request: PrefillRequest, timeout_s: float = 20.0) -> PrefillReply:
        """PREFILL on instance `name`, called from its own host."""
        config = load_config(self.tmp_path / f"{name}.yaml")

        async def call() -> PrefillReply:
            clients = PeerClients(config, config.instance_named(name))
            try:
                reply = await clients.for_instance(config.instance_named(name)).call(PREFILL, request,
                                                                                       timeout_s=timeout_s)
                assert isinstance(reply, PrefillReply)
                return reply
            finally:
                await clients.close()

        return self.on(name, call, timeout_s + 5.0)

    def complete(self, conductor: str, tokens: list[int], max_tokens: int, timeout_s: float) -> tuple[int, Any]:
        """A greedy completion through `conductor`, from its own host: the HTTP status and body."""
        async def post() -> tuple[int, Any]:
            body = {"model": "tiny", "prompt": tokens, "max_tokens": max_tokens, "temperature": 0.0,
                    "ignore_eos": True}
            async with aiohttp.ClientSession() as http, http.post(f"{self.url(conductor)}/v1/completions",
                                                                  json=body) as response:
                return response.status, await response.json()
        return self.on(conductor, post, timeout_s)

    def migrations(self, conductor: str) -> float:
        """The conductor's mooncaked_migrations_total, over every cause."""
        async def get() -> float:
            async with aiohttp.ClientSession() as http, http.get(f"{self.url(conductor)}/metrics") as response:
                text = await response.text()
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("mooncaked_migrations_total{"))
        return self.on(conductor, get, 10.0)

    def up(self) -> NetworkFleet:
        self.net.up()
        try:
            self.net.set_rate(SLOW_HOST, 0, FAST_MBIT / 10)
            self.net.set_rate(SLOW_HOST, 1, FAST_MBIT / 10)
            for host in range(self.net.num_hosts):
                self.hosts.append(HostLoop(self.net, host))
            self.hosts[ETCD_HOST].call(self._start_etcd, 30.0)
            for name, role, _, _ in INSTANCES:
                self.start(name)
            self.wait_converged(30.0)
        except BaseException:
            self.down()
            raise
        return self

    async def _start_etcd(self) -> None:
        self.etcd = EtcdServer(self.tmp_path / "etcd", host=self.net.nic_address(ETCD_HOST, 1))
        self.etcd.client_port, self.etcd.peer_port = 2379, 2380
        await self.etcd.start()

    def start(self, name: str) -> None:
        """Start instance `name` on its host (again, after `stop`)."""
        config = load_config(self._write_config(name))

        async def start() -> None:
            role = make_role(config, config.instance_named(name))
            await role.start()
            self.roles[name] = role

        self.on(name, start, 60.0)

    def stop(self, name: str) -> None:
        role = self.roles.pop(name)
        self.on(name, role.stop, 30.0)

    def wait_converged(self, timeout_s: float) -> float:
        """Seconds until both conductors see every worker and store up (TimeoutError after `timeout_s`)."""
        started = time.monotonic()
        for conductor in ("c0", "c1"):
            self.wait(conductor, lambda view: all(self._is_up(view, name) for name in WORKERS if name in self.roles),
                      timeout_s - (time.monotonic() - started), f"{conductor} sees every member up")
        return time.monotonic() - started

    def wait(self, conductor: str, condition: Callable[[Any], bool], timeout_s: float, what: str) -> None:
        """Poll `condition(conductor's view)` on its loop until true; TimeoutError after `timeout_s`."""
        async def poll() -> None:
            view = self.conductor(conductor).view
            deadline = time.monotonic() + max(timeout_s, 0.0)
            while not condition(view):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not within {timeout_s:.1f} s: {what}")
                await asyncio.sleep(0.05)
        self.on(conductor, poll, timeout_s + 5.0)

    @staticmethod
    def _is_up(view: Any, name: str) -> bool:
        if name.startswith("s"):
            follower = view.followers.get(name)
            return follower is not None and follower.is_up
        worker = view.prefill.get(name) or view.decode.get(name)
        return worker is not None and worker.is_placeable

    def down(self) -> None:
        roles, self.roles = self.roles, {}
        stopping = [(name, self.host_of(name), self.host_of(name).submit(role.stop, _STOP_TIMEOUT_S))
                    for name, role in roles.items()]  # all at once: each waits out its drain notice
        for name, host, future in stopping:
            try:
                host.result(future, _STOP_TIMEOUT_S)
            except Exception:  # the rest must still go
                logger.exception("stopping %s", name)
        for host in self.hosts:
            host.close()
        if self.etcd is not None:
            self.etcd.kill()
        self.net.down()

    def _write_config(self, name: str) -> Path:
        _, role, host, port = next(entry for entry in INSTANCES if entry[0] == name)
        entry: dict[str, Any] = {"name": name, "role": role, "host": self.net.nic_address(host, 0), "port": port}
        if role == "store":
            entry["data_port"] = port + 1
        if role == "conductor":
            entry["rpc_port"] = port + 1
        nics = {self.net.nic_address(h, 0): [{"name": f"nic{k}", "address": f"{self.net.nic_address(h, k)}/24"}
                                            for k in range(self.net.num_nics)] for h in range(self.net.num_hosts)}
        data: dict[str, Any] = {
            "cluster": {"id": "netfaults", "membership": "etcd", "instances": [entry],
                        "etcd": {"endpoints": [self.etcd_endpoint], "lease_ttl_s": LEASE_TTL_S,
                                 "call_timeout_s": 1.0, "min_backoff_s": 0.05, "max_backoff_s": 0.5}},
            "model": {"source": "random:tiny", "name": "tiny", "max_model_len": 1024},
            "kv": {"block_size": 16},
            "runtime": {"drain_timeout_s": 2.0},
            "rpc": {"connect_timeout_s": 1.0},
            "store": {"dram_bytes": 32 << 20, "shm_dir": str(self.tmp_path), "maintenance_interval_s": 0.05},
            "worker": {"num_kv_pages": 256, "prefill_chunk": 256, "max_batch_tokens": 1024, "abort_grace_s": 0.5,
                       "inline_prefill_max_tokens": 0, "profile_s": 0, "kv_load_timeout_s": 8.0},
            "conductor": {"load_poll_interval_s": 0.1, "load_poll_timeout_s": 1.0},
            "pd_controller": {"enabled": False},
            "transfer": {"nics": nics, "io_timeout_s": 1.0, "path_cooldown_s": 1.0, "timeout_s": 10.0},
        }
        path = self.tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(data))
        return path
