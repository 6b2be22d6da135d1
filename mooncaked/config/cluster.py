"""The `cluster` section of the configuration: which instances make the cluster, where they listen, how they
find each other, and which prefill instances form pipeline groups.

1. config.py builds ClusterSection from YAML (then `--set` overrides) with the other sections
   (config/sections.py); config/validate.py checks names, roles, ports and groups across instances.
2. A process finds its own InstanceConfig (Config.instance_for) and its role's section with the instance's
   `settings` applied (Config.role_section); a prefill instance its group (Config.prefill_group_of).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from mooncaked.config.schema import bounded

ROLES = ("conductor", "prefill", "decode", "store")
Role = Literal["conductor", "prefill", "decode", "store"]


@dataclass(frozen=True)
class InstanceConfig:
    name: str
    role: Role
    host: str = "127.0.0.1"
    port: int = bounded(0, min=0, max=65535, doc="RPC port (conductor: HTTP port)")
    rpc_port: int = bounded(0, min=0, max=65535, doc="conductor only: RPC port (0: none)")
    data_port: int = bounded(0, min=0, max=65535, doc="store only: transfer engine data port")
    metrics_port: int = bounded(0, min=0, max=65535, doc="prefill/decode/store: Prometheus /metrics (0: none)")
    cpus: list[int] = bounded([], doc="CPU ids this instance's process runs on (empty: any)")
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EtcdSection:
    """Where membership lives when `cluster.membership: etcd` (see mooncaked/cluster/etcd_membership.py)."""

    endpoints: list[str] = bounded(["http://127.0.0.1:2379"])
    prefix: str = "/mooncaked"
    lease_ttl_s: int = bounded(5, min=1, max=3600)
    call_timeout_s: float = bounded(2.0, min=0.01)
    min_backoff_s: float = bounded(0.2, min=0.01)
    max_backoff_s: float = bounded(5.0, min=0.01)
    watch_renew_s: float = bounded(30.0, min=0.1)
    drain_notice_s: float = bounded(0.5, min=0.0)
    startup_timeout_s: float = bounded(5.0, min=0.0)
    ca_file: Optional[str] = None  # https endpoints: the CA that signed etcd's certificate (None: the system's)
    cert_file: Optional[str] = None  # a client certificate for etcd's --client-cert-auth (with key_file)
    key_file: Optional[str] = None
    username: Optional[str] = None  # etcd's authentication (with password_file)
    password_file: Optional[str] = None  # read once at start, never logged


@dataclass(frozen=True)
class PrefillGroupConfig:
    """Prefill instances that prefill long prompts together as a pipeline (chunked pipeline parallelism):
    member i holds layers layer_splits[i-1]..layer_splits[i] (an even split when `layer_splits` is empty); the
    first member takes PREFILL and holds the embedding, the last one the final norm and the output head."""

    name: str
    members: list[str]
    layer_splits: list[int] = bounded([], doc="first layer of members 1.. (empty: an even split)")

    def stage_of(self, instance_name: str) -> int | None:
        return self.members.index(instance_name) if instance_name in self.members else None


@dataclass(frozen=True)
class ClusterSection:
    id: str = "mooncaked"
    secret_file: Optional[str] = None
    membership: str = bounded("static", choices=("static", "etcd"))
    etcd: EtcdSection = field(default_factory=EtcdSection)
    instances: list[InstanceConfig] = field(default_factory=list)
    prefill_groups: list[PrefillGroupConfig] = field(default_factory=list)
