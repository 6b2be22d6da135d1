"""In-process clusters on loopback for role tests: free ports, configs, and start/stop of role objects."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from mooncaked.bench.cluster import free_port
from mooncaked.config import Config, load_config
from mooncaked.roles import make_role
from mooncaked.runtime.lifecycle import Role


def instance(name: str, role: str, host: str = "127.0.0.1", **extra: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": name, "role": role, "host": host, "port": free_port(host)}
    if role == "store":
        entry["data_port"] = free_port(host)
    if role == "conductor":
        entry["rpc_port"] = 0
    entry.update(extra)
    return entry


def cluster_config(tmp_path: Path, instances: Sequence[dict[str, Any]], **sections: dict[str, Any]) -> Config:
    """A config for `instances` with the tiny random model and small pools; `sections` override per key."""
    data: dict[str, Any] = {
        "cluster": {"id": f"test-{tmp_path.name}", "instances": list(instances)},
        "model": {"source": "random:tiny", "name": "tiny", "max_model_len": 1024},
        "kv": {"block_size": 16},
        "runtime": {"drain_timeout_s": 2.0},
        "store": {"dram_bytes": 32 << 20, "shm_dir": str(tmp_path), "maintenance_interval_s": 0.05},
        "worker": {"num_kv_pages": 256, "prefill_chunk": 64, "max_batch_tokens": 256, "abort_grace_s": 0.5},
        "transfer": {"timeout_s": 10.0},
    }
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    import yaml

    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


@contextlib.asynccontextmanager
async def running_roles(config: Config, names: Sequence[str]) -> AsyncIterator[dict[str, Role]]:
    """Start the named instances in order; stop them in reverse order on exit."""
    roles: dict[str, Role] = {}
    try:
        for name in names:
            role = make_role(config, config.instance_named(name))
            await role.start()
            roles[name] = role
        yield roles
    finally:
        for name in reversed(list(roles)):
            await roles[name].stop()
