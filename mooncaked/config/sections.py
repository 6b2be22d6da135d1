"""The sections of the configuration: one frozen dataclass per YAML section, with each field's bounds (the
`cluster` section, the list of instances and groups, is in config/cluster.py).

1. config.py builds `Config` from them (YAML, then `--set` overrides) and config/validate.py checks what one
   field's bounds cannot express.
2. `Config` holds one of each; `Config.instance_for(role, name, host, port)` finds a process's entry in the
   cluster list, `Config.role_section(instance)` its role's section with the instance's `settings` applied (a
   prefill or decode instance's override fields of `worker`, a store's of `store`, a conductor's of
   `conductor`: ROLE_SECTION).

Every option is documented in config.example.yaml.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from mooncaked.config.cluster import ClusterSection, InstanceConfig, PrefillGroupConfig
from mooncaked.config.schema import ConfigIssue, bounded, suggest
from mooncaked.runtime.errors import StartupError

ROLE_SECTION = {"conductor": "conductor", "prefill": "worker", "decode": "worker", "store": "store"}  # Config attrs


@dataclass(frozen=True)
class ModelSection:
    source: str = bounded("embedded:smollm2", doc="embedded:smollm2 | HF dir | .gguf | random:<preset>")
    name: str = "smollm2-135m"
    dtype: str = bounded("float32", choices=("float32", "float16", "bfloat16"))
    device: str = "cpu"
    kernel_backend: str = bounded("auto", choices=("auto", "triton", "torch"))
    cpu_packed_gemm: bool = True
    cuda_graphs: bool = False
    tensor_parallel_size: int = bounded(1, min=1, max=64, doc="ranks (processes; one GPU each on CUDA) per instance")
    expert_parallel: bool = bounded(False, doc="MoE models with ranks: each rank holds n_experts / N whole experts "
                                    "(else a slice of every expert)")
    share_weights: bool = True
    weight_cache_dir: Optional[str] = bounded(None, doc="null: $XDG_CACHE_HOME/mooncaked/weights, resolved at start")
    max_model_len: int = bounded(2048, min=16)
    seed: int = 0


@dataclass(frozen=True)
class RuntimeSection:
    num_threads: int = bounded(1, min=1, max=1024)
    gil_switch_interval_ms: float = bounded(0.5, min=0.01, max=100.0)
    log_level: str = bounded("info", choices=("debug", "info", "warning", "error"))
    log_format: str = bounded("text", choices=("text", "json"))
    drain_timeout_s: float = bounded(10.0, min=0.0)


@dataclass(frozen=True)
class RpcSection:
    max_frame_bytes: int = bounded(16 * 1024 * 1024, min=1024)
    max_inflight_calls: int = bounded(1024, min=1)
    pool_size: int = bounded(2, min=1, max=64)
    connect_timeout_s: float = bounded(3.0, min=0.01)
    call_timeout_s: float = bounded(30.0, min=0.01)


@dataclass(frozen=True)
class KvSection:
    block_size: int = bounded(64, min=1, max=4096)
    device_prefix_cache: bool = True
    cache_dtype: str = bounded("auto", choices=("auto", "int8", "fp8_e4m3"),
                               doc="auto: the model's dtype; int8, fp8_e4m3: 8-bit values, a bfloat16 scale per "
                                   "token and KV head")


@dataclass(frozen=True)
class NicConfig:
    """One NIC of a host for TCP transfers (transfer/nics.py)."""

    name: str
    address: str = bounded("", doc="its IP address, with /prefix: its subnet (NIC pairs join within one)")
    numa_node: Optional[int] = bounded(None, min=0, max=1023, doc="memory it serves: cpu:<node> (null: all)")
    devices: list[str] = bounded([], doc="GPUs it serves too, e.g. [cuda:0]")
    rdma_device: str = bounded("", doc="its RDMA device (e.g. mlx5_0): RDMA path choice from this entry")


@dataclass(frozen=True)
class TransferSection:
    transports: list[str] = bounded(["local", "tcp"])
    slice_bytes: int = bounded(64 * 1024, min=4096)
    num_connections_per_peer: int = bounded(4, min=1, max=64)
    max_retries: int = bounded(3, min=0, max=100)
    path_cooldown_s: float = bounded(5.0, min=0.0)
    path_failure_threshold: int = bounded(2, min=1, max=1000)
    tcp_frame_bytes: int = bounded(16 << 20, min=4096)
    tcp_send_buffer_bytes: int = bounded(256 << 10, min=0)
    io_timeout_s: float = bounded(10.0, min=0.01)
    idle_timeout_s: float = bounded(300.0, min=1.0, max=86_400.0)
    timeout_s: float = bounded(30.0, min=0.01)
    sysfs_root: str = "/sys"
    topology: Optional[dict[str, Any]] = None
    max_endpoints: int = bounded(256, min=1)
    nics: dict[str, list[NicConfig]] = bounded({}, doc="host (as in cluster.instances) -> its NICs")


@dataclass(frozen=True)
class StoreSection:
    dram_bytes: int = bounded(1 << 30, min=1 << 20)
    shm_dir: str = "/dev/shm"
    ssd_dir: Optional[str] = None
    ssd_bytes: int = bounded(8 << 30, min=0)
    eviction_policy: str = bounded("lru", choices=("lru", "lfu", "length_aware"))
    high_watermark: float = bounded(0.95, min=0.0, max=1.0)
    low_watermark: float = bounded(0.85, min=0.01, max=1.0)
    default_lease_ms: int = bounded(30_000, min=1)
    max_lease_ms: int = bounded(600_000, min=1)
    maintenance_interval_s: float = bounded(0.5, min=0.01)
    max_events_buffered: int = bounded(100_000, min=16)
    numa_node: Optional[int] = bounded(None, min=0, max=1023, doc="bind the pool here (null: the NIC's node)")


@dataclass(frozen=True)
class SchedulerSection:
    policy: str = bounded("kvcache_centric",
                          choices=("kvcache_centric", "cache_aware", "load_balancing", "random"))
    admission: str = bounded("early_rejection_predicted",
                             choices=("none", "baseline", "early_rejection", "early_rejection_predicted"))
    kvcache_balancing_threshold: float = bounded(2.0, min=1.0)
    ttft_slo_ms: float = bounded(30_000.0, min=1.0)
    tbt_slo_ms: float = bounded(1_000.0, min=1.0)
    link_gbps: float = bounded(100.0, min=0.001)
    prefill_profile: Optional[str] = None
    decode_time_s: float = bounded(5.0, min=0.001)
    max_decode_defer_s: float = bounded(0.0, min=0.0)
    predict_output_length: bool = True
    output_length_quantile: float = bounded(0.9, min=0.01, max=1.0)
    device_flops: Optional[float] = bounded(None, min=1.0)
    device_memory_bandwidth: Optional[float] = bounded(None, min=1.0)
    seed: int = 0
    replication: str = bounded("by_reuse", choices=("always", "by_reuse"))
    heat_half_life_s: float = bounded(60.0, min=0.001)
    replica_displaced_reuse: float = bounded(0.5, min=0.0)
    tie_break: str = bounded("coldest_store", choices=("first", "coldest_store"))
    cpp_min_tokens: int = bounded(2048, min=0, doc="prompts longer than this may go to a prefill group")


@dataclass(frozen=True)
class ConductorSection:
    api_keys_file: Optional[str] = None
    tenants_file: Optional[str] = None
    max_body_bytes: int = bounded(8 << 20, min=1024)
    request_timeout_s: float = bounded(600.0, min=0.1)
    prefill_timeout_s: float = bounded(120.0, min=0.1)
    first_token_timeout_s: float = bounded(120.0, min=0.1)
    token_timeout_s: float = bounded(30.0, min=0.1)
    retry_after_s: int = bounded(1, min=0)
    default_max_tokens: int = bounded(256, min=1)
    load_poll_interval_s: float = bounded(0.2, min=0.01)
    load_poll_timeout_s: float = bounded(1.0, min=0.01)
    startup_sync_timeout_s: float = bounded(5.0, min=0.0)
    events_renew_s: float = bounded(30.0, min=0.1)
    spare_marks_interval_s: float = bounded(0.5, min=0.01)
    max_migrations: int = bounded(2, min=0, max=16)
    client_timeout_s: float = bounded(30.0, min=0.1)
    max_connections_per_client: int = bounded(256, min=1)
    max_cache_ttl_s: float = bounded(86_400.0, min=1.0, doc="longest ttl_s of a context cache (POST /v1/caches)")
    default_cache_ttl_s: float = bounded(3600.0, min=1.0, doc="ttl_s of a context cache that names none")
    cache_quota_tokens: int = bounded(1_000_000, min=0, doc="context-cache tokens one API key may hold")
    cache_refresh_s: float = bounded(5.0, min=0.05, doc="how often the cache listing is rebuilt from the stores")
    batch_dir: Optional[str] = None  # files and batch state of the Batch API; None: /v1/files and /v1/batches off
    max_file_bytes: int = bounded(200 << 20, min=1024, doc="largest upload to POST /v1/files")
    max_batch_lines: int = bounded(50_000, min=1, doc="most lines in one batch input file")
    batch_max_in_flight: int = bounded(2, min=1, doc="batch lines being served at once")
    batch_slo_margin: float = bounded(0.5, min=0.01, max=1.0,
                                      doc="a batch line starts only when predicted TTFT and TBT stay under this "
                                      "fraction of their SLOs")
    batch_backoff_s: float = bounded(2.0, min=0.0, doc="pause of batch lines after an interactive rejection")


@dataclass(frozen=True)
class WorkerSection:
    """Settings shared by prefill and decode instances (a model replica with paged KV)."""

    num_kv_pages: Optional[int] = bounded(None, min=1, doc="explicit page count; overrides the memory budget")
    kv_memory_bytes: Optional[int] = bounded(None, min=1, doc="KV page budget (null: 192 MiB on CPU)")
    memory_fraction: Optional[float] = bounded(None, min=0.01, max=1.0, doc="CUDA: of free memory (null: 0.9)")
    max_batch_size: int = bounded(32, min=1)
    max_batch_tokens: int = bounded(1024, min=16)
    prefill_chunk: int = bounded(1024, min=16)
    inline_prefill_max_tokens: int = bounded(256, min=0)
    kv_load_timeout_s: float = bounded(60.0, min=0.01)
    abort_grace_s: float = bounded(35.0, min=0.0)
    page_wait_s: float = bounded(10.0, min=0.0, max=3600.0)
    max_layers_in_flight: int = bounded(4, min=1, max=1024)
    tensor_parallel_size: Optional[int] = bounded(None, min=1, max=64,
                                                  doc="this instance's ranks (null: model.tensor_parallel_size)")
    compute_cpus: list[int] = bounded([], doc="CPU ids the compute thread runs on (empty: the process's)")
    copy_cpus: list[int] = bounded([], doc="CPU ids the KV copy thread runs on (empty: the process's)")
    profile_s: float = bounded(5.0, min=0.0, max=600.0)
    switchable: bool = False
    cpp_chunk_tokens: int = bounded(1024, min=16, doc="a prefill group's pipeline chunk (new tokens per chunk)")
    cpp_poll_interval_s: float = bounded(1.0, min=0.01, doc="a group's first stage polls the other stages' models")


@dataclass(frozen=True)
class PdControllerSection:
    """The dynamic P/D ratio controller that the elected conductor runs (mooncaked/roles/conductor/leader.py)."""

    enabled: bool = True
    interval_s: float = bounded(1.0, min=0.01)
    window: int = bounded(10, min=1, max=10_000)
    tolerance: float = bounded(0.5, min=0.0)
    trim_fraction: float = bounded(0.1, min=0.0, max=0.49)
    scale_out_load: float = bounded(0.9, min=0.0)
    scale_in_load: float = bounded(0.05, min=0.0)
    min_per_side: int = bounded(1, min=0)
    num_confirm: int = bounded(3, min=1, max=1000)
    dwell_s: float = bounded(10.0, min=0.0)
    switch_timeout_s: float = bounded(30.0, min=0.1)
    horizon_s: float = bounded(60.0, min=0.1)
    gain_margin: float = bounded(2.0, min=0.0)
    switch_cost_s: float = bounded(5.0, min=0.0)
    dwell_per_cost: float = bounded(3.0, min=0.0)
    reversal_factor: float = bounded(2.0, min=1.0)


class ConfigError(StartupError):
    """Every problem found in a configuration, one per line."""

    def __init__(self, issues: list[ConfigIssue]) -> None:
        self.issues = issues
        super().__init__("\n".join(str(i) for i in issues))


@dataclass(frozen=True)
class Config:
    cluster: ClusterSection = field(default_factory=ClusterSection)
    model: ModelSection = field(default_factory=ModelSection)
    runtime: RuntimeSection = field(default_factory=RuntimeSection)
    rpc: RpcSection = field(default_factory=RpcSection)
    kv: KvSection = field(default_factory=KvSection)
    transfer: TransferSection = field(default_factory=TransferSection)
    store: StoreSection = field(default_factory=StoreSection)
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    conductor: ConductorSection = field(default_factory=ConductorSection)
    worker: WorkerSection = field(default_factory=WorkerSection)
    pd_controller: PdControllerSection = field(default_factory=PdControllerSection)

    def instances_of(self, role: str) -> list[InstanceConfig]:
        return [i for i in self.cluster.instances if i.role == role]

    def instance_named(self, name: str) -> InstanceConfig:
        for instance in self.cluster.instances:
            if instance.name == name:
                return instance
        names = [i.name for i in self.cluster.instances]
        raise ConfigError([ConfigIssue("cluster.instances", f"no instance named {name!r}" + suggest(name, names))])

    def prefill_group_of(self, instance_name: str) -> PrefillGroupConfig | None:
        """The prefill group `instance_name` is a member of, if any."""
        return next((g for g in self.cluster.prefill_groups if instance_name in g.members), None)

    def store_for_host(self, host: str) -> InstanceConfig | None:
        return next((i for i in self.instances_of("store") if i.host == host), None)

    def instance_for(self, role: str, name: str | None = None, host: str | None = None,
                     port: int | None = None) -> InstanceConfig:
        """This process's entry: by name, else the single one of `role` matching host/port."""
        if name is not None:
            instance = self.instance_named(name)
            if instance.role != role:
                raise ConfigError([ConfigIssue("cluster.instances", f"instance {name!r} has role "
                                               f"{instance.role!r}, not {role!r}")])
            return instance
        matches = [i for i in self.instances_of(role)
                   if (host is None or i.host == host) and (port is None or i.port == port)]
        if len(matches) != 1:
            what = "no" if not matches else f"{len(matches)}"
            raise ConfigError([ConfigIssue("cluster.instances", f"{what} {role} instances match; "
                                           "pass --instance NAME to choose one")])
        return matches[0]

    def tensor_parallel_size_of(self, instance: InstanceConfig) -> int:
        """The ranks a prefill or decode instance runs: its own setting, else model.tensor_parallel_size."""
        override = instance.settings.get("tensor_parallel_size")  # validated with the other settings
        return override if isinstance(override, int) and override >= 1 else self.model.tensor_parallel_size

    def role_section(self, instance: InstanceConfig) -> Any:
        """The instance's role section with its `settings` applied (validated at load time)."""
        base = getattr(self, ROLE_SECTION[instance.role])
        if not instance.settings:
            return base
        return dataclasses.replace(base, **instance.settings)
