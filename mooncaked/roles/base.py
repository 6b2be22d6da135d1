"""What every role shares: its RPC endpoint serving `health` and `info`, and clients to its peers.

1. `RoleEndpoint(config, instance)` builds the RPC server for this instance (secret read once from
   cluster.secret_file) and registers `health` and `info`; the role adds its own methods before `start()`.
2. `start()` listens on the instance's host and port; `stop()` stops accepting, drains in-flight calls up to
   runtime.drain_timeout_s, then cancels the rest.
3. `PeerClients` holds one pooled RpcClient per peer address, created on first use and closed on stop.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mooncaked import __version__
from mooncaked.config import Config, ConfigError, InstanceConfig
from mooncaked.config.schema import ConfigIssue
from mooncaked.rpc import (HEALTH, INFO, CallContext, HealthReply, HealthRequest, InfoReply, InfoRequest, Method,
                           RpcClient, RpcServer)
from mooncaked.transfer import TransferEngine
from mooncaked.transfer.nics import Nic
from mooncaked.transfer.topology import Topology, topology_from_nics


def make_transfer_engine(config: Config, host: str, port: int) -> TransferEngine:
    """The transfer engine of one process, from the `transfer` section (with the NICs listed for `host`); RDMA's
    path choice from `transfer.topology`, else from the NICs naming an `rdma_device`, else discovered."""
    transfer = config.transfer
    nics = [(nic.rdma_device, Nic.parse(nic.name, nic.address, nic.numa_node, nic.devices))
            for nic in transfer.nics.get(host, [])]
    topology = Topology.from_config(transfer.topology) if transfer.topology is not None else None
    if topology is None and any(device for device, _ in nics):
        topology = topology_from_nics([(device, nic) for device, nic in nics if device])
    return TransferEngine(
        host=host, port=port, transports=transfer.transports, slice_bytes=transfer.slice_bytes,
        num_connections_per_peer=transfer.num_connections_per_peer, max_retries=transfer.max_retries,
        path_cooldown_s=transfer.path_cooldown_s, path_failure_threshold=transfer.path_failure_threshold,
        tcp_frame_bytes=transfer.tcp_frame_bytes, tcp_send_buffer_bytes=transfer.tcp_send_buffer_bytes,
        connect_timeout_s=config.rpc.connect_timeout_s,
        io_timeout_s=transfer.io_timeout_s, idle_timeout_s=transfer.idle_timeout_s, topology=topology,
        sysfs_root=transfer.sysfs_root,
        max_endpoints=transfer.max_endpoints, cluster_id=config.cluster.id,
        secret=read_secret(config.cluster.secret_file),
        nics=[nic for _, nic in nics])


def read_secret(path: str | None) -> bytes | None:
    """The cluster secret, stripped of surrounding whitespace; never logged."""
    if path is None:
        return None
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ConfigError([ConfigIssue("cluster.secret_file", f"cannot read {path}: {exc.strerror}")]) from None
    if not secret:
        raise ConfigError([ConfigIssue("cluster.secret_file", f"{path} is empty")])
    return secret


class RoleEndpoint:
    """Owns this instance's RpcServer."""

    def __init__(self, config: Config, instance: InstanceConfig, *, port: int | None = None,
                 is_healthy: Callable[[], bool] = lambda: True,
                 extra_info: Callable[[], dict[str, str]] = dict) -> None:
        self.config = config
        self.instance = instance
        self.port = instance.port if port is None else port
        self.bound_port = 0
        self._is_healthy = is_healthy
        self._extra_info = extra_info
        self._started_at = time.monotonic()
        self.server = RpcServer(role=instance.role, instance=instance.name, cluster_id=config.cluster.id,
                                secret=read_secret(config.cluster.secret_file),
                                max_frame_bytes=config.rpc.max_frame_bytes,
                                max_inflight_calls=config.rpc.max_inflight_calls)
        self.server.add_method(HEALTH, self._health, is_eager=True)
        self.server.add_method(INFO, self._info, is_eager=True)

    def add_method(self, method: Method, handler: Any, *, is_eager: bool = False) -> None:
        """`is_eager`: the handler awaits nothing slow and opens no timeout scope, so it may run inline."""
        self.server.add_method(method, handler, is_eager=is_eager)

    async def _health(self, request: HealthRequest, ctx: CallContext) -> HealthReply:
        is_healthy = self._is_healthy()
        return HealthReply(is_healthy=is_healthy, status="ok" if is_healthy else "unhealthy")

    async def _info(self, request: InfoRequest, ctx: CallContext) -> InfoReply:
        return InfoReply(role=self.instance.role, instance=self.instance.name, version=__version__,
                         pid=os.getpid(), uptime_s=time.monotonic() - self._started_at, extra=self._extra_info())

    async def start(self) -> None:
        self.bound_port = await self.server.start_tcp(self.instance.host, self.port)

    async def stop(self) -> None:
        await self.server.stop(self.config.runtime.drain_timeout_s)


class PeerClients:
    """Owns one pooled RpcClient per peer instance of this process."""

    def __init__(self, config: Config, me: InstanceConfig) -> None:
        self.config = config
        self.me = me
        self._secret = read_secret(config.cluster.secret_file)
        self._clients: dict[str, RpcClient] = {}

    def for_instance(self, peer: InstanceConfig, port: int | None = None) -> RpcClient:
        address = f"tcp://{peer.host}:{peer.port if port is None else port}"
        client = self._clients.get(address)
        if client is None:
            client = RpcClient(address, role=self.me.role, instance=self.me.name, cluster_id=self.config.cluster.id,
                               secret=self._secret, pool_size=self.config.rpc.pool_size,
                               connect_timeout_s=self.config.rpc.connect_timeout_s)
            self._clients[address] = client
        return client

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.close()
