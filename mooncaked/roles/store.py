"""StoreRole: one host's KVCache pool behind RPC (docs/design.md section 6).

1. Build: the transfer engine (data endpoint on `instance.host:instance.data_port`), the StoreService (pool file
   `<shm_dir>/mooncaked-<cluster>-<instance>`, SSD directory `<ssd_dir>/<instance>` when configured), its named
   context caches (StoreCaches) and the RPC endpoint (health, info, the methods of store/messages.py and
   kv/cache_messages.py).
2. `start()`: engine, then service (pool, SSD index, segment, maintenance), then RPC: nothing is served before
   the pool exists.
3. `stop()`: end event streams, then RPC (stop accepting, drain within runtime.drain_timeout_s, cancel the rest),
   then the service (maintenance, SSD backlog, pool file), then the engine.
"""

from __future__ import annotations

import logging
import os

from mooncaked.config import Config, InstanceConfig, StoreSection
from mooncaked.roles.base import RoleEndpoint, make_transfer_engine
from mooncaked.runtime.metrics import Metrics
from mooncaked.runtime.metrics_http import MetricsEndpoint
from mooncaked.runtime.numa import allowed_memory_nodes
from mooncaked.store.cache_service import StoreCaches
from mooncaked.store.service import StoreService, StoreServiceConfig
from mooncaked.store.shm_pool import pool_path
from mooncaked.transfer.topology import nic_numa_node

logger = logging.getLogger(__name__)


def service_config(config: Config, instance: InstanceConfig, section: StoreSection) -> StoreServiceConfig:
    ssd_dir = os.path.join(section.ssd_dir, instance.name) if section.ssd_dir else None
    return StoreServiceConfig(
        pool_path=pool_path(config.cluster.id, instance.name, section.shm_dir),
        dram_bytes=section.dram_bytes,
        host=instance.host,
        segment_name=f"kvpool-{instance.name}",
        eviction_policy=section.eviction_policy,
        high_watermark=section.high_watermark,
        low_watermark=section.low_watermark,
        ssd_dir=ssd_dir,
        ssd_bytes=section.ssd_bytes if ssd_dir else 0,
        max_lease_ms=section.max_lease_ms,
        max_pin_ms=int(config.conductor.max_cache_ttl_s * 1000),
        max_events=section.max_events_buffered,
        maintenance_interval_s=section.maintenance_interval_s,
        stop_timeout_s=config.runtime.drain_timeout_s,
        numa_node=pool_numa_node(section.numa_node, nic_numa_node(config.transfer.sysfs_root),
                                 allowed_memory_nodes()),
    )


def pool_numa_node(configured: int | None, nic_node: int | None, allowed: set[int]) -> int | None:
    """Where the pool's pages go: `store.numa_node` when set (checked when the pool is made), else the NIC's
    node when this process may allocate there, else nowhere in particular (None)."""
    if configured is not None:
        return configured
    if nic_node is not None and nic_node not in allowed:
        logger.warning("the RDMA NIC is on NUMA node %d, where this process may not allocate (allowed: %s): "
                       "the store pool is left unbound", nic_node, sorted(allowed))
        return None
    return nic_node


class StoreRole:
    """Owns the store's transfer engine, service, context caches and RPC endpoint."""

    name = "store"

    def __init__(self, config: Config, instance: InstanceConfig) -> None:
        section: StoreSection = config.role_section(instance)
        self.instance = instance
        self.engine = make_transfer_engine(config, instance.host, instance.data_port)
        self.service = StoreService(service_config(config, instance, section), self.engine)
        self.endpoint = RoleEndpoint(config, instance, is_healthy=self._is_healthy, extra_info=self._info)
        self.service.add_methods(self.endpoint.server)
        self.caches = StoreCaches(self.service.core, self.service.clock, int(config.conductor.max_cache_ttl_s * 1000))
        self.caches.add_methods(self.endpoint.server)
        self.metrics = Metrics()
        self.metrics_endpoint = MetricsEndpoint(instance.host, instance.metrics_port, self.metrics,
                                                self._refresh_metrics)
        self._num_evicted_seen = 0
        self.name = f"store {instance.name}"

    async def start(self) -> None:
        await self.engine.start()
        await self.service.start()
        await self.endpoint.start()
        await self.metrics_endpoint.start()
        logger.info("store %s serving rpc on %s:%d, data on %s, pool %s (%d bytes)", self.instance.name,
                    self.instance.host, self.endpoint.bound_port, self.engine.endpoint,
                    self.service.config.pool_path, self.service.config.dram_bytes)

    async def stop(self) -> None:
        await self.metrics_endpoint.stop()
        self.service.streams.end()  # long-lived event streams would otherwise hold the drain to its deadline
        await self.endpoint.stop()
        await self.service.stop()
        await self.engine.stop()

    def _refresh_metrics(self) -> None:
        stats = self.service.core.stats()
        cache = self.metrics.cache
        cache.set_store_usage("dram", used_bytes=stats["used_bytes"], capacity_bytes=stats["capacity_bytes"],
                              num_blocks=stats["num_dram_blocks"])
        if self.service.ssd is not None:
            cache.set_store_usage("ssd", used_bytes=self.service.ssd.num_used_bytes,
                                  capacity_bytes=self.service.config.ssd_bytes, num_blocks=stats["num_ssd_blocks"])
        tenants = self.service.core.tenants
        self.metrics.tenants.set_pool_bytes("dram", tenants.dram_bytes)
        self.metrics.tenants.set_pool_bytes("ssd", tenants.ssd_bytes)
        cache.observe_evictions("dram", stats["num_evicted"] - self._num_evicted_seen)
        self._num_evicted_seen = stats["num_evicted"]

    def _is_healthy(self) -> bool:
        return self.service.pool is not None

    def _info(self) -> dict[str, str]:
        stats = self.service.core.stats()
        return {
            "pool_path": self.service.config.pool_path,
            "segment": self.service.segment_name,
            "incarnation": f"{self.service.incarnation:x}",
            "data_endpoint": self.engine.endpoint if self.service.pool is not None else "",
            "used_bytes": str(stats["used_bytes"]),
            "capacity_bytes": str(stats["capacity_bytes"]),
            "num_blocks": str(stats["num_blocks"]),
        }
