"""The one frozen configuration of a process.

1. `load_config(path, overrides)` reads YAML, applies `--set key.path=value` overrides to the raw data, then
   builds the frozen dataclasses below, collecting every error (`ConfigError` lists them all).
2. `Config.instance_for(role, name, host, port)` finds this process's entry in the shared cluster list.
3. `Config.role_section(instance)` gives that role's section with the instance's own overrides applied.

Every option is documented in config.example.yaml; tests/test_config.py checks that the file loads and names
every key. Derived facts (KV block counts, EOS ids) are not config: they live with the components.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from mooncaked.config_schema import ConfigIssue, bounded, build, suggest
from mooncaked.errors import StartupError

ROLES = ("conductor", "prefill", "decode", "store")
Role = Literal["conductor", "prefill", "decode", "store"]


class ConfigError(StartupError):
    """Every problem found in a configuration, one per line."""

    def __init__(self, issues: list[ConfigIssue]) -> None:
        self.issues = issues
        super().__init__("\n".join(str(i) for i in issues))


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
    timeout_s: float = bounded(30.0, min=0.01)
    sysfs_root: str = "/sys"
    topology: Optional[dict[str, Any]] = None
    max_endpoints: int = bounded(256, min=1)


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
    batch_max_in_flight: int = bounded(4, min=1, doc="batch lines being served at once")
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
    max_layers_in_flight: int = bounded(4, min=1, max=1024)
    compute_cpus: list[int] = bounded([], doc="CPU ids the compute thread runs on (empty: the process's)")
    copy_cpus: list[int] = bounded([], doc="CPU ids the KV copy thread runs on (empty: the process's)")
    profile_s: float = bounded(5.0, min=0.0, max=600.0)
    switchable: bool = False
    cpp_chunk_tokens: int = bounded(1024, min=16, doc="a prefill group's pipeline chunk (new tokens per chunk)")
    cpp_poll_interval_s: float = bounded(1.0, min=0.01, doc="a group's first stage polls the other stages' models")


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
    """Where membership lives when `cluster.membership: etcd` (see mooncaked/etcd_membership.py)."""

    endpoints: list[str] = bounded(["http://127.0.0.1:2379"])
    prefix: str = "/mooncaked"
    lease_ttl_s: int = bounded(5, min=1, max=3600)
    call_timeout_s: float = bounded(2.0, min=0.01)
    min_backoff_s: float = bounded(0.2, min=0.01)
    max_backoff_s: float = bounded(5.0, min=0.01)
    watch_renew_s: float = bounded(30.0, min=0.1)
    drain_notice_s: float = bounded(0.5, min=0.0)
    startup_timeout_s: float = bounded(5.0, min=0.0)


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

    def role_section(self, instance: InstanceConfig) -> Any:
        """The instance's role section with its `settings` applied (validated at load time)."""
        base = _role_base_section(self, instance.role)
        if not instance.settings:
            return base
        return dataclasses.replace(base, **instance.settings)


_ROLE_SECTION = {"conductor": "conductor", "prefill": "worker", "decode": "worker", "store": "store"}


def _role_base_section(config: Config, role: str) -> Any:
    return getattr(config, _ROLE_SECTION[role])


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """YAML file (or defaults when None), then `key.path=value` overrides; raises ConfigError."""
    issues: list[ConfigIssue] = []
    data: Any = {}
    if path is not None:
        data = _read_yaml(Path(path), issues)
    for override in overrides or []:
        data = apply_override(data, override, issues)
    config = build(Config, data, "", issues) if not issues else None
    if config is not None:
        issues.extend(validate(config))
    if issues or config is None:
        raise ConfigError(issues or [ConfigIssue("", "invalid configuration")])
    return config


def _read_yaml(path: Path, issues: list[ConfigIssue]) -> Any:
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        issues.append(ConfigIssue("", f"config file {path} does not exist"))
        return {}
    except yaml.YAMLError as exc:
        issues.append(ConfigIssue("", f"{path} is not valid YAML: {exc}"))
        return {}
    return {} if data is None else data


def apply_override(data: Any, override: str, issues: list[ConfigIssue]) -> Any:
    """Apply one `a.b.c=value` (value parsed as YAML; list items by index: `cluster.instances.0.port=1`)."""
    key_path, sep, raw = override.partition("=")
    if not sep or not key_path:
        issues.append(ConfigIssue("", f"override {override!r} is not key.path=value"))
        return data
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw
    if not isinstance(data, dict):
        data = {}
    node: Any = data
    parts = key_path.split(".")
    for depth, part in enumerate(parts):
        is_last = depth == len(parts) - 1
        node = _descend(node, part, value if is_last else None, is_last, ".".join(parts[: depth + 1]), issues)
        if node is None:
            break
    return data


def _descend(node: Any, part: str, value: Any, is_last: bool, where: str, issues: list[ConfigIssue]) -> Any:
    if isinstance(node, list):
        if not part.isdigit() or int(part) >= len(node):
            issues.append(ConfigIssue(where, f"no list item {part!r} (have {len(node)})"))
            return None
        if is_last:
            node[int(part)] = value
            return None
        return node[int(part)]
    if not isinstance(node, dict):
        issues.append(ConfigIssue(where, "cannot set a key below a non-mapping value"))
        return None
    if is_last:
        node[part] = value
        return None
    child = node.get(part)
    if child is None:
        child = node[part] = {}
    return child


def validate(config: Config) -> list[ConfigIssue]:
    """Cross-field checks that a single field's bounds cannot express."""
    issues: list[ConfigIssue] = []
    if config.store.low_watermark > config.store.high_watermark:
        issues.append(ConfigIssue("store.low_watermark", "must not exceed store.high_watermark"))
    if config.conductor.default_cache_ttl_s > config.conductor.max_cache_ttl_s:
        issues.append(ConfigIssue("conductor.default_cache_ttl_s", "must not exceed conductor.max_cache_ttl_s"))
    for transport in config.transfer.transports:
        if transport not in ("local", "tcp", "rdma"):
            issues.append(ConfigIssue("transfer.transports", f"unknown transport {transport!r}"
                                      + suggest(transport, ["local", "tcp", "rdma"])))
    if config.conductor.tenants_file is not None and config.conductor.api_keys_file is not None:
        issues.append(ConfigIssue("conductor.tenants_file", "set either tenants_file or api_keys_file, not both "
                                  "(a tenant's api_keys list replaces the keys file)"))
    if config.model.cuda_graphs and not config.model.device.startswith("cuda"):
        issues.append(ConfigIssue("model.cuda_graphs", f"needs a CUDA model.device, got {config.model.device!r}; "
                                  "set it to false on CPU"))
    issues.extend(_validate_cpu_list(config.worker.compute_cpus, "worker.compute_cpus"))
    issues.extend(_validate_cpu_list(config.worker.copy_cpus, "worker.copy_cpus"))
    issues.extend(_validate_instances(config))
    issues.extend(_validate_membership(config))
    issues.extend(_validate_kv_budget(config.worker, config.model.device, "worker"))
    for index, instance in enumerate(config.cluster.instances):
        if instance.role in ("prefill", "decode") and instance.settings:
            where = f"cluster.instances[{index}].settings"
            merged = build(WorkerSection, {**dataclasses.asdict(config.worker), **instance.settings}, where, [])
            if merged is not None:  # a bad setting is reported by _validate_settings
                issues.extend(_validate_kv_budget(merged, config.model.device, where))
    issues.extend(_validate_prefill_groups(config))
    issues.extend(_validate_tensor_parallel(config))
    return issues


def _validate_tensor_parallel(config: Config) -> list[ConfigIssue]:
    """Tensor parallelism runs model-level (engine.tp_runner, `bench model --tp`); instances do not run it yet."""
    num_ranks = config.model.tensor_parallel_size
    if num_ranks == 1:
        return []
    where = "model.tensor_parallel_size"
    if config.model.cuda_graphs:
        return [ConfigIssue(where, f"{num_ranks} ranks cannot replay CUDA graphs; set model.cuda_graphs: false")]
    workers = [i.name for i in config.cluster.instances if i.role in ("prefill", "decode")]
    if workers:
        return [ConfigIssue(where, f"{num_ranks}: prefill and decode instances ({', '.join(workers[:3])}) do not run "
                            "tensor parallelism yet (README: Tensor parallelism); set it to 1")]
    return []


def _validate_kv_budget(section: WorkerSection, device: str, where: str) -> list[ConfigIssue]:
    if section.memory_fraction is None:
        return []
    if section.kv_memory_bytes is not None:
        return [ConfigIssue(f"{where}.memory_fraction", "set either kv_memory_bytes or memory_fraction, not both")]
    if not device.startswith("cuda"):
        return [ConfigIssue(f"{where}.memory_fraction", f"sizes KV from free GPU memory but model.device is "
                            f"{device!r}; set {where}.kv_memory_bytes instead")]
    return []


def _validate_cpu_list(cpus: list[int], where: str) -> list[ConfigIssue]:
    if any(cpu < 0 for cpu in cpus) or len(set(cpus)) != len(cpus):
        return [ConfigIssue(where, f"CPU ids must be distinct and >= 0, got {cpus}")]
    return []


def _validate_membership(config: Config) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = []
    etcd = config.cluster.etcd
    if etcd.min_backoff_s > etcd.max_backoff_s:
        issues.append(ConfigIssue("cluster.etcd.min_backoff_s", "must not exceed cluster.etcd.max_backoff_s"))
    if config.pd_controller.scale_in_load >= config.pd_controller.scale_out_load:
        issues.append(ConfigIssue("pd_controller.scale_in_load", "must be below pd_controller.scale_out_load"))
    if config.cluster.membership != "etcd":
        return issues
    if not etcd.endpoints:
        issues.append(ConfigIssue("cluster.etcd.endpoints", "needs at least one http://host:port with etcd"))
    for index, endpoint in enumerate(etcd.endpoints):
        problem = endpoint_problem(endpoint)
        if problem:
            issues.append(ConfigIssue(f"cluster.etcd.endpoints[{index}]", problem))
    if not etcd.prefix.startswith("/") or etcd.prefix.endswith("/") and etcd.prefix != "/":
        issues.append(ConfigIssue("cluster.etcd.prefix", f"must start with '/' and not end with one, "
                                  f"got {etcd.prefix!r}"))
    if "/" in config.cluster.id or not config.cluster.id:
        issues.append(ConfigIssue("cluster.id", f"must be non-empty without '/' with etcd, got {config.cluster.id!r}"))
    return issues


def endpoint_problem(endpoint: str) -> str:
    """'' for an http(s)://host:port URL etcd's gateway can answer on, else what is wrong with it."""
    scheme, sep, rest = endpoint.partition("://")
    host, colon, port = rest.rstrip("/").rpartition(":")
    if not sep or scheme not in ("http", "https") or not colon or not host or "/" in host:
        return f"expected http://host:port, got {endpoint!r}"
    if not port.isdigit() or not 0 < int(port) < 65536:
        return f"port must be 1-65535 in {endpoint!r}"
    return ""


def _validate_instances(config: Config) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = []
    seen_names: set[str] = set()
    seen_ports: set[tuple[str, int]] = set()
    for index, instance in enumerate(config.cluster.instances):
        where = f"cluster.instances[{index}]"
        if instance.name in seen_names:
            issues.append(ConfigIssue(f"{where}.name", f"duplicate instance name {instance.name!r}"))
        seen_names.add(instance.name)
        for port in (instance.port, instance.rpc_port, instance.data_port, instance.metrics_port):
            if port and (instance.host, port) in seen_ports:
                issues.append(ConfigIssue(where, f"port {port} on {instance.host} is used twice"))
            seen_ports.add((instance.host, port))
        issues.extend(_validate_cpu_list(instance.cpus, f"{where}.cpus"))
        issues.extend(_validate_settings(config, instance, f"{where}.settings"))
    return issues


def _validate_prefill_groups(config: Config) -> list[ConfigIssue]:
    """Names unique, two or more members each, no instance in two groups, layer splits increasing; with static
    membership also: every member a configured, non-switchable prefill instance, all with one chunk size."""
    issues: list[ConfigIssue] = []
    names: set[str] = set()
    grouped: set[str] = set()
    for index, group in enumerate(config.cluster.prefill_groups):
        where = f"cluster.prefill_groups[{index}]"
        if not group.name or group.name in names:
            issues.append(ConfigIssue(f"{where}.name", f"must be non-empty and unique, got {group.name!r}"))
        names.add(group.name)
        if len(group.members) < 2:
            issues.append(ConfigIssue(f"{where}.members", f"a group needs at least 2 members, got {group.members}"))
        for member in group.members:
            if member in grouped:
                issues.append(ConfigIssue(f"{where}.members", f"{member!r} is in more than one prefill group "
                                          "(or twice in this one)"))
            grouped.add(member)
        splits = group.layer_splits
        if splits and (len(splits) != len(group.members) - 1 or splits[0] < 1
                       or any(b <= a for a, b in zip(splits, splits[1:]))):
            issues.append(ConfigIssue(f"{where}.layer_splits", f"needs {len(group.members) - 1} increasing layer "
                                      f"indices >= 1 (the first layer of members 1..), got {splits}"))
        if config.cluster.membership == "static":
            issues.extend(_validate_group_members(config, group, where))
    return issues


def _validate_group_members(config: Config, group: PrefillGroupConfig, where: str) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = []
    known = {i.name: i for i in config.cluster.instances}
    chunk_sizes = set()
    for member in group.members:
        instance = known.get(member)
        if instance is None or instance.role != "prefill":
            what = "no instance" if instance is None else f"a {instance.role} instance"
            hint = suggest(member, list(known)) if instance is None else ""
            issues.append(ConfigIssue(f"{where}.members", f"{member!r} is {what}; members must be prefill "
                                      "instances of cluster.instances" + hint))
            continue
        section = config.role_section(instance) if not _has_bad_settings(config, instance) else config.worker
        if section.switchable:
            issues.append(ConfigIssue(f"{where}.members", f"{member!r} is switchable; a group member holds only "
                                      "its layers and cannot become a decode instance"))
        chunk_sizes.add(section.cpp_chunk_tokens)
    if len(chunk_sizes) > 1:
        issues.append(ConfigIssue(f"{where}.members", f"members set different worker.cpp_chunk_tokens "
                                  f"{sorted(chunk_sizes)}; the pipeline needs one"))
    return issues


def _has_bad_settings(config: Config, instance: InstanceConfig) -> bool:
    return bool(_validate_settings(config, instance, ""))


def _validate_settings(config: Config, instance: InstanceConfig, where: str) -> list[ConfigIssue]:
    if not instance.settings:
        return []
    base = _role_base_section(config, instance.role)
    issues: list[ConfigIssue] = []
    merged = {**dataclasses.asdict(base), **instance.settings}
    build(type(base), merged, where, issues)
    return issues


def config_as_dict(config: Config) -> dict[str, Any]:
    """Plain data for printing (`check-config`) and for handing to child processes."""
    return dataclasses.asdict(config)
