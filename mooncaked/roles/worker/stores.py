"""A worker's connections to the stores its requests' KV moves through: its own host's and any other host's.

1. `await connect_local()` (the worker's start): find the store on this host (with etcd it may register after the
   worker, so wait for it up to `cluster.etcd.startup_timeout_s`) and connect to it; its client maps the store's
   shared-memory pool (`local`, `local_name`).
2. `await client(name)` connects to another host's store on first use (bytes then move through the transfer
   engine); concurrent first uses share one connection. A name that came off the wire must be a configured store
   instance (`instance_of`: InvalidArgument else); its pool file's path comes from this worker's own config
   (`pool_path_of`).
3. `await close()` (the worker's stop): close every client.
"""

from __future__ import annotations

import asyncio
import contextlib

from mooncaked.cluster.membership import Membership, store_on_host
from mooncaked.config import Config, InstanceConfig
from mooncaked.roles.base import PeerClients
from mooncaked.rpc import InvalidArgument
from mooncaked.store.client import StoreClient
from mooncaked.store.shm_pool import pool_path
from mooncaked.transfer import TransferEngine


class WorkerStores:
    """Owns the worker's store clients and their connect locks; the membership, peer clients and transfer engine
    are the Worker's."""

    def __init__(self, config: Config, instance: InstanceConfig, membership: Membership, peers: PeerClients,
                 engine: TransferEngine) -> None:
        self.config = config
        self.instance = instance
        self.membership = membership
        self.peers = peers
        self.engine = engine
        self.local_name = ""
        self._clients: dict[str, StoreClient] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def connect_local(self) -> None:
        self.local_name = await self._find_local()
        await self.client(self.local_name)

    async def _find_local(self) -> str:
        """The store on this host; with etcd it may register after us, so wait for it up to a deadline."""
        store = store_on_host(self.membership, self.instance.host)
        if store is None and self.config.cluster.membership == "etcd":
            appeared = asyncio.Event()
            self.membership.add_listener(lambda name, old, new: appeared.set() if new and new.role == "store" else None)
            deadline = asyncio.get_running_loop().time() + self.config.cluster.etcd.startup_timeout_s
            while store is None and asyncio.get_running_loop().time() < deadline:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(appeared.wait(), deadline - asyncio.get_running_loop().time())
                appeared.clear()
                store = store_on_host(self.membership, self.instance.host)
        if store is None:
            raise RuntimeError(f"no store instance is configured on host {self.instance.host}; "
                               "every prefill and decode host needs one")
        return store.name

    async def client(self, store_name: str) -> StoreClient:
        client = self._clients.get(store_name)
        if client is not None:
            return client
        lock = self._locks.setdefault(store_name, asyncio.Lock())
        async with lock:
            if store_name not in self._clients:
                peer = self.instance_of(store_name)
                rpc = self.peers.for_instance(peer)
                self._clients[store_name] = await StoreClient.connect(
                    rpc, host=self.instance.host, pool_path=self.pool_path_of(peer), engine=self.engine,
                    timeout_s=self.config.transfer.timeout_s)
            return self._clients[store_name]

    @property
    def local(self) -> StoreClient:
        return self._clients[self.local_name]

    def pool_path_of(self, store: InstanceConfig) -> str:
        """Where the store's pool file is on its host, from this worker's own config (never from the store): its
        entry in cluster.instances with its settings, else the common store section."""
        configured = next((i for i in self.config.cluster.instances if i.name == store.name), store)
        return pool_path(self.config.cluster.id, store.name, self.config.role_section(configured).shm_dir)

    def instance_of(self, store_name: str) -> InstanceConfig:
        """The configured store called `store_name`; InvalidArgument for anything else (it came off the wire)."""
        record = self.membership.members().get(store_name)
        if record is None or record.role != "store":
            raise InvalidArgument(f"{store_name!r} is not a store instance of this cluster")
        return record.instance_config()

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.close()
