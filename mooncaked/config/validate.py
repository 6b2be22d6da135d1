"""Cross-field checks of a built `Config`: what a single field's bounds (schema.bounded) cannot express.

1. `validate(config)` returns every issue found (config.py's `load_config` raises them together as ConfigError):
   watermarks and TTLs in order, known transports, CPU lists, unique instance names and ports, membership and
   etcd endpoints, KV budgets (per instance too), prefill groups and their members, per-instance settings.
"""

from __future__ import annotations

import dataclasses

from mooncaked.config.cluster import InstanceConfig, PrefillGroupConfig
from mooncaked.config.schema import ConfigIssue, build, suggest
from mooncaked.config.sections import ROLE_SECTION, Config, WorkerSection
from mooncaked.transfer.nics import Nic


def validate(config: Config) -> list[ConfigIssue]:
    """Cross-field checks that a single field's bounds cannot express."""
    issues: list[ConfigIssue] = []
    if config.store.low_watermark > config.store.high_watermark:
        issues.append(ConfigIssue("store.low_watermark", "must not exceed store.high_watermark"))
    if config.conductor.default_cache_ttl_s > config.conductor.max_cache_ttl_s:
        issues.append(ConfigIssue("conductor.default_cache_ttl_s", "must not exceed conductor.max_cache_ttl_s"))
    if config.transfer.io_timeout_s >= config.transfer.idle_timeout_s:
        issues.append(ConfigIssue("transfer.idle_timeout_s", "must exceed transfer.io_timeout_s (an idle data "
                                  "connection is closed after it; a frame's each send or receive has io_timeout_s)"))
    for transport in config.transfer.transports:
        if transport not in ("local", "tcp", "rdma"):
            issues.append(ConfigIssue("transfer.transports", f"unknown transport {transport!r}"
                                      + suggest(transport, ["local", "tcp", "rdma"])))
    issues.extend(_validate_nics(config))
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
    issues.extend(_validate_cache_dtype(config))
    return issues


def _validate_nics(config: Config) -> list[ConfigIssue]:
    """Each host's NICs parse (transfer/nics.py) and have unique names and addresses."""
    issues = []
    for host, nics in config.transfer.nics.items():
        for index, nic in enumerate(nics):
            try:
                Nic.parse(nic.name, nic.address, nic.numa_node, nic.devices)
            except ValueError as exc:
                issues.append(ConfigIssue(f"transfer.nics.{host}[{index}]", str(exc)))
        for what in ("name", "address"):
            values = [getattr(nic, what).partition("/")[0] for nic in nics]
            if len(set(values)) < len(values):
                issues.append(ConfigIssue(f"transfer.nics.{host}", f"two NICs with one {what}: {values}"))
        devices = [nic.rdma_device for nic in nics if nic.rdma_device]
        if len(set(devices)) < len(devices):
            issues.append(ConfigIssue(f"transfer.nics.{host}", f"two NICs with one rdma_device: {devices}"))
        if devices and config.transfer.topology is not None:
            issues.append(ConfigIssue(f"transfer.nics.{host}", "transfer.topology and the NICs' rdma_device both "
                                      "give RDMA's path choice; keep one (rdma_device: the NIC list drives both "
                                      "transports)"))
    return issues


def _validate_cache_dtype(config: Config) -> list[ConfigIssue]:
    """Compressed KV runs on both kernel backends, but not yet under CUDA graphs (engine/runner.py)."""
    if config.kv.cache_dtype == "auto" or not config.model.cuda_graphs:
        return []
    return [ConfigIssue("kv.cache_dtype", f"{config.kv.cache_dtype} KV runs without CUDA graphs; set "
                        "model.cuda_graphs: false (or kv.cache_dtype: auto to keep the graphs)")]


def _validate_tensor_parallel(config: Config) -> list[ConfigIssue]:
    """Prefill and decode instances run N ranks (roles/worker/tp_worker.py; an instance's
    `settings: {tensor_parallel_size: N}` overrides the model's): N processes on CPU, one GPU each on CUDA."""
    where = "model.tensor_parallel_size"
    parallel = [i for i in config.cluster.instances
                if i.role in ("prefill", "decode") and config.tensor_parallel_size_of(i) > 1]
    names = ", ".join(i.name for i in parallel[:3])
    if config.model.cuda_graphs and (config.model.tensor_parallel_size > 1 or parallel):
        ranks = (f"{config.model.tensor_parallel_size} ranks" if config.model.tensor_parallel_size > 1
                 else f"instances with ranks ({names})")
        return [ConfigIssue(where, f"{ranks} cannot replay CUDA graphs; set model.cuda_graphs: false")]
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
    if (etcd.cert_file is None) != (etcd.key_file is None):
        issues.append(ConfigIssue("cluster.etcd.cert_file", "set cert_file and key_file together (a client "
                                  "certificate and its key), or neither"))
    if (etcd.username is None) != (etcd.password_file is None):
        issues.append(ConfigIssue("cluster.etcd.username", "set username and password_file together, or neither"))
    is_tls = any(endpoint.startswith("https://") for endpoint in etcd.endpoints)
    for key in ("ca_file", "cert_file"):
        if getattr(etcd, key) is not None and not is_tls:
            issues.append(ConfigIssue(f"cluster.etcd.{key}", "needs https:// endpoints in cluster.etcd.endpoints"))
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
    base = getattr(config, ROLE_SECTION[instance.role])
    issues: list[ConfigIssue] = []
    merged = {**dataclasses.asdict(base), **instance.settings}
    build(type(base), merged, where, issues)
    return issues
