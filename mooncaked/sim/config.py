"""Simulator configuration: a small YAML file parsed into frozen dataclasses (see sim.example.yaml).

1. `load_sim_config(path)` reads YAML; `parse_sim_config(mapping)` validates it. Every error names the key
   (`cluster.num_prefill: must be an integer >= 1, got 'x'`); unknown keys are errors, never ignored.
2. Sections: `cluster` (instances, prefill groups, DRAM per host, link bandwidth), `model` and `gpu` (the cost model),
   `scheduler` (a `mooncaked.sched.types.PolicyConfig`), `run` (trace speed, seed, sampling).
3. `with_overrides(config, scheduler=..., ...)` gives a copy for command-line overrides and experiments.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mooncaked.kv.eviction import POLICY_NAMES
from mooncaked.sched.types import PolicyConfig
from mooncaked.sim.output_forecast import MODES as FORECAST_MODES


DEFAULT_CPP_MIN_TOKENS = 2048  # the conductor's scheduler.cpp_min_tokens default


class SimConfigError(ValueError):
    """A sim config value is missing, mistyped or out of range; the message names the key."""


@dataclass(frozen=True)
class ClusterConfig:
    num_prefill: int = 16
    num_decode: int = 16
    dram_blocks_per_host: int = 5859  # 3M tokens in 512-token blocks (paper section 7.3.1)
    decode_hosts_in_pool: bool = True  # decode hosts' DRAM also serves as prefix cache
    eviction: str = "lru"
    link_bandwidth_gbps: float = 800.0  # B_nic of Table 1
    link_latency_s: float = 0.0005
    h2d_bandwidth_gbps: float = 1024.0  # B_h2d of Table 1: 128 GB/s
    max_batch_size: int = 128
    num_prefill_groups: int = 0  # prefill groups (chunked pipeline parallelism) made of num_prefill's nodes
    stages_per_group: int = 2  # nodes per group, each holding an equal share of the layers
    cpp_chunk_tokens: int = 1024  # new tokens per pipeline chunk (worker.cpp_chunk_tokens)
    max_batch_tokens: int = 1024  # prefill: new tokens per forward (worker.max_batch_tokens)
    prefill_chunk: int = 1024  # prefill: a prompt with more new tokens runs alone (worker.prefill_chunk)
    inline_prefill_max_tokens: int = 0  # decode: prefill inline when the uncached part is at most this (0: never)
    device_prefix_blocks: int = 0  # per prefill and decode instance: KV pages (blocks) its device prefix cache uses


@dataclass(frozen=True)
class ModelConfig:
    """LLaMA3-70B (Table 1)."""

    num_layers: int = 80
    hidden_size: int = 8192
    gqa: int = 8
    dtype_bytes: int = 2
    flops_a: float = 4.0
    flops_b: float = 22.0
    weight_bytes: float = 141e9
    # from a model's own config (`mooncaked sim --model-config`, model/sim_shape.py); 0: Eq. 1's LLaMA shape above
    kv_bytes_per_token: int = 0  # else l * 2 * (d / gqa) * s
    active_parameters: float = 0.0  # else prefill's linear FLOPs are l * b * d^2 per token, not 2 x these
    attention_width: int = 0  # else d in Eq. 1's quadratic term


@dataclass(frozen=True)
class GpuConfig:
    """One 8xA800 node as one instance (Table 1: 8 x 312 TFLOPS)."""

    flops: float = 8 * 312e12
    mfu: float = 0.5
    hbm_bytes: float = 8 * 80e9
    hbm_bandwidth: float = 8 * 2.039e12
    hbm_utilisation: float = 0.5
    prefill_overhead_s: float = 0.02
    decode_overhead_s: float = 0.005
    decode_per_request_s: float = 0.0003
    kv_memory_fraction: float = 0.9  # of HBM left after weights


@dataclass(frozen=True)
class RunConfig:
    speed: float = 1.0
    seed: int = 0
    max_requests: int = 0  # 0: the whole trace
    output_length_cap: int = 0  # 0: as in the trace; 1 isolates prefill (section 7.3.2)
    output_length_scale: float = 1.0  # multiplies trace output lengths (a decode-heavier variant of a trace)
    tbt_counts_handoff: bool = False  # count the first gap (KV load into the decode GPU) in TBT
    prefill_noise: float = 0.0  # sigma of a log-normal factor on true prefill times (predictions stay exact)
    output_length_predictor: str = "uniform"  # uniform (the paper's t_d) | oracle | learned (see output_forecast)
    output_length_noise: float = 0.0  # oracle: sigma of a log-normal factor on the true output length
    output_length_quantile: float = 0.9  # learned: the quantile it predicts
    max_tokens: int = 4096  # learned: every request's max_tokens (the trace has none)
    sample_interval_s: float = 10.0


@dataclass(frozen=True)
class SimConfig:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    scheduler: PolicyConfig = field(default_factory=lambda: PolicyConfig(cpp_min_tokens=DEFAULT_CPP_MIN_TOKENS))
    run: RunConfig = field(default_factory=RunConfig)


_SECTIONS: dict[str, type] = {
    "cluster": ClusterConfig,
    "model": ModelConfig,
    "gpu": GpuConfig,
    "scheduler": PolicyConfig,
    "run": RunConfig,
}
_NON_NEGATIVE = {"link_latency_s", "prefill_overhead_s", "decode_overhead_s", "decode_per_request_s",
                 "max_requests", "output_length_cap", "prefill_noise", "seed", "dram_blocks_per_host",
                 "output_length_noise", "replica_displaced_reuse", "num_prefill_groups", "cpp_min_tokens",
                 "inline_prefill_max_tokens", "kv_bytes_per_token", "active_parameters", "attention_width",
                 "device_prefix_blocks", "max_decode_defer_s"}


def load_sim_config(path: str | Path, base: SimConfig | None = None) -> SimConfig:
    """Reads and validates a sim YAML file; keys it leaves out keep `base`'s values (the defaults when None)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise SimConfigError(f"cannot read sim config {path}: {exc}") from exc
    data = yaml.safe_load(text) or {}
    if not isinstance(data, Mapping):
        raise SimConfigError(f"{path}: the top level must be a mapping of sections")
    return parse_sim_config(data, base)


def parse_sim_config(data: Mapping[str, Any], base: SimConfig | None = None) -> SimConfig:
    config = SimConfig() if base is None else base
    for name, value in data.items():
        if name not in _SECTIONS:
            raise SimConfigError(f"{name}: unknown section; valid sections: {', '.join(_SECTIONS)}")
        if not isinstance(value, Mapping):
            raise SimConfigError(f"{name}: must be a mapping")
        config = with_overrides(config, name, **{str(key): item for key, item in value.items()})
    return config


def with_overrides(config: SimConfig, section: str, **values: Any) -> SimConfig:
    """A copy of `config` with some keys of one section replaced (validated like the file)."""
    current = dataclasses.asdict(getattr(config, section))
    current.update(values)
    return dataclasses.replace(config, **{section: _parse_section(section, _SECTIONS[section], current)})


def _parse_section(name: str, cls: type, values: Mapping[str, Any]) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    defaults = cls()
    parsed: dict[str, Any] = {}
    for key, value in values.items():
        if key not in fields:
            raise SimConfigError(f"{name}.{key}: unknown key; valid keys: {', '.join(fields)}")
        parsed[key] = _check_value(f"{name}.{key}", value, getattr(defaults, key), key)
    if name == "run" and parsed.get("output_length_predictor", "uniform") not in FORECAST_MODES:
        raise SimConfigError(f"run.output_length_predictor: must be one of {', '.join(FORECAST_MODES)}, "
                             f"got {parsed['output_length_predictor']!r}")
    if name == "cluster" and parsed.get("eviction", "lru") not in POLICY_NAMES:
        raise SimConfigError(f"cluster.eviction: must be one of {', '.join(POLICY_NAMES)}, got {parsed['eviction']!r}")
    if name == "cluster":
        _check_groups(parsed)
    try:
        return cls(**parsed)
    except ValueError as exc:
        raise SimConfigError(f"{name}: {exc}") from exc


def _check_groups(cluster: Mapping[str, Any]) -> None:
    stages = cluster.get("stages_per_group", ClusterConfig.stages_per_group)
    if stages < 2:
        raise SimConfigError(f"cluster.stages_per_group: a group needs at least 2 stages, got {stages}")
    num_nodes = cluster.get("num_prefill_groups", 0) * stages
    num_prefill = cluster.get("num_prefill", ClusterConfig.num_prefill)
    if num_nodes > num_prefill:
        raise SimConfigError(f"cluster.num_prefill_groups: {num_nodes} group nodes "
                             f"(num_prefill_groups x stages_per_group) exceed cluster.num_prefill = {num_prefill}")


def _check_value(key_path: str, value: Any, default: Any, key: str) -> Any:
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise SimConfigError(f"{key_path}: must be true or false, got {value!r}")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise SimConfigError(f"{key_path}: must be an integer, got {value!r}")
        if value < 0 or (value == 0 and key not in _NON_NEGATIVE):
            raise SimConfigError(f"{key_path}: must be {'>= 0' if key in _NON_NEGATIVE else '>= 1'}, got {value}")
        return value
    if isinstance(default, float):
        if isinstance(value, str):  # YAML 1.1 reads 141.0e9 (no exponent sign) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SimConfigError(f"{key_path}: must be a number, got {value!r}")
        if value < 0 or (value == 0 and key not in _NON_NEGATIVE):
            raise SimConfigError(f"{key_path}: must be {'>= 0' if key in _NON_NEGATIVE else '> 0'}, got {value}")
        return float(value)
    if not isinstance(value, str):
        raise SimConfigError(f"{key_path}: must be a string, got {value!r}")
    return value
