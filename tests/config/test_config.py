"""Config: every validation path, overrides, instance lookup, the example file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from mooncaked.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "config.example.yaml"


def write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def errors_of(tmp_path: Path, data: object, overrides: list[str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, data), overrides)
    return str(info.value)


def test_example_file_loads_and_has_four_roles() -> None:
    config = load_config(EXAMPLE)
    assert sorted(i.role for i in config.cluster.instances) == ["conductor", "decode", "prefill", "store"]
    assert config.model.source == "embedded:smollm2"


def test_example_file_documents_every_option() -> None:
    """Every leaf key of the dataclasses appears, with a comment, in config.example.yaml."""
    from mooncaked.config import Config
    import dataclasses

    text = EXAMPLE.read_text()
    for section in dataclasses.fields(Config):
        if section.name == "cluster":
            continue
        section_type = type(getattr(Config(), section.name))
        assert re.search(rf"^{section.name}:", text, re.M), section.name
        for option in dataclasses.fields(section_type):
            assert re.search(rf"^\s+{option.name}:.*#", text, re.M), f"{section.name}.{option.name} undocumented"


def test_defaults_without_file() -> None:
    config = load_config(None)
    assert config.kv.block_size == 64 and config.cluster.instances == []


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_invalid_yaml(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)


def test_typo_suggests_nearest_key(tmp_path: Path) -> None:
    message = errors_of(tmp_path, {"kv": {"blok_size": 16}})
    assert "kv.blok_size: unknown key (did you mean 'block_size'?)" in message


def test_unknown_section_suggests(tmp_path: Path) -> None:
    assert "did you mean 'store'" in errors_of(tmp_path, {"stor": {}})


def test_type_and_range_errors_are_all_collected(tmp_path: Path) -> None:
    message = errors_of(tmp_path, {"kv": {"block_size": "big"}, "rpc": {"pool_size": 0},
                                   "store": {"high_watermark": 1.5}, "runtime": {"log_level": "loud"}})
    assert "kv.block_size: expected int, got 'big'" in message
    assert "rpc.pool_size: must be >= 1" in message
    assert "store.high_watermark: must be <= 1.0" in message
    assert "runtime.log_level: must be one of" in message
    assert len(message.splitlines()) == 4


def test_bool_is_not_an_int(tmp_path: Path) -> None:
    assert "expected int" in errors_of(tmp_path, {"kv": {"block_size": True}})


def test_int_accepted_for_float(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, {"runtime": {"drain_timeout_s": 3}}))
    assert config.runtime.drain_timeout_s == 3.0


def test_cross_field_watermarks(tmp_path: Path) -> None:
    message = errors_of(tmp_path, {"store": {"high_watermark": 0.5, "low_watermark": 0.6}})
    assert "store.low_watermark: must not exceed store.high_watermark" in message


def test_unknown_transport(tmp_path: Path) -> None:
    assert "unknown transport 'tpc' (did you mean 'tcp'?)" in errors_of(tmp_path, {"transfer": {"transports": ["tpc"]}})


def test_instance_errors(tmp_path: Path) -> None:
    data = {"cluster": {"instances": [
        {"name": "a", "role": "store", "port": 1},
        {"name": "a", "role": "prefil", "port": 1},
        {"role": "decode"},
    ]}}
    message = errors_of(tmp_path, data)
    assert "cluster.instances[1].role: must be one of" in message and "did you mean 'prefill'" in message
    assert "cluster.instances[2].name: required key is missing" in message


def test_duplicate_names_and_ports(tmp_path: Path) -> None:
    data = {"cluster": {"instances": [{"name": "a", "role": "store", "port": 5},
                                      {"name": "a", "role": "decode", "port": 5}]}}
    message = errors_of(tmp_path, data)
    assert "duplicate instance name 'a'" in message and "port 5 on 127.0.0.1 is used twice" in message


def test_instance_settings_validated_and_applied(tmp_path: Path) -> None:
    bad = {"cluster": {"instances": [{"name": "p", "role": "prefill", "settings": {"num_kv_pagez": 4}}]}}
    assert "cluster.instances[0].settings.num_kv_pagez: unknown key" in errors_of(tmp_path, bad)
    good = {"cluster": {"instances": [{"name": "p", "role": "prefill", "settings": {"num_kv_pages": 4}}]}}
    config = load_config(write(tmp_path, good))
    assert config.role_section(config.instance_named("p")).num_kv_pages == 4


def test_overrides(tmp_path: Path) -> None:
    config = load_config(EXAMPLE, ["kv.block_size=16", "cluster.instances.0.port=9000", "store.ssd_dir=/x"])
    assert config.kv.block_size == 16
    assert config.cluster.instances[0].port == 9000
    assert config.store.ssd_dir == "/x"


def test_bad_overrides(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(EXAMPLE, ["kv.block_size", "cluster.instances.9.port=1", "kv.block_size.x=1", "kv.blocksize=2"])
    message = str(info.value)
    assert "is not key.path=value" in message
    assert "no list item '9'" in message
    assert "cannot set a key below a non-mapping value" in message


def test_override_typo_is_reported() -> None:
    with pytest.raises(ConfigError, match="kv.blocksize: unknown key .did you mean 'block_size'"):
        load_config(EXAMPLE, ["kv.blocksize=2"])


def test_instance_lookup() -> None:
    config = load_config(EXAMPLE)
    assert config.instance_for("store").name == "store0"
    assert config.instance_for("decode", name="decode0").port == 7104
    with pytest.raises(ConfigError, match="has role 'decode', not 'prefill'"):
        config.instance_for("prefill", name="decode0")
    with pytest.raises(ConfigError, match="did you mean 'decode0'"):
        config.instance_named("decod0")
    assert config.store_for_host("127.0.0.1") is not None


def test_ambiguous_instance(tmp_path: Path) -> None:
    data = {"cluster": {"instances": [{"name": "p1", "role": "prefill", "port": 1},
                                      {"name": "p2", "role": "prefill", "port": 2}]}}
    config = load_config(write(tmp_path, data))
    with pytest.raises(ConfigError, match="pass --instance NAME"):
        config.instance_for("prefill")


def test_kv_budget_settings_are_checked_together(tmp_path: Path) -> None:
    both = errors_of(tmp_path, {"model": {"device": "cuda"}, "worker": {"kv_memory_bytes": 1 << 30,
                                                                        "memory_fraction": 0.5}})
    assert "worker.memory_fraction: set either kv_memory_bytes or memory_fraction, not both" in both
    on_cpu = errors_of(tmp_path, {"worker": {"memory_fraction": 0.5}})
    assert ("worker.memory_fraction: sizes KV from free GPU memory but model.device is 'cpu'; set "
            "worker.kv_memory_bytes instead") in on_cpu
    per_instance = errors_of(tmp_path, {"cluster": {"instances": [
        {"name": "d", "role": "decode", "settings": {"memory_fraction": 0.8}}]}})
    assert "cluster.instances[0].settings.memory_fraction: sizes KV from free GPU memory" in per_instance
    assert "memory_fraction: must be <= 1.0" in errors_of(tmp_path, {"worker": {"memory_fraction": 1.5}})
    config = load_config(write(tmp_path, {"model": {"device": "cuda:1"}, "worker": {"memory_fraction": 0.6},
                                          "cluster": {"instances": [{"name": "d", "role": "decode",
                                                                     "settings": {"num_kv_pages": 64}}]}}))
    assert config.worker.memory_fraction == 0.6 and config.worker.num_kv_pages is None
    assert config.role_section(config.instance_named("d")).num_kv_pages == 64


def test_cuda_graphs_need_a_cuda_device(tmp_path: Path) -> None:
    message = errors_of(tmp_path, {"model": {"cuda_graphs": True, "device": "cpu"}})
    assert "model.cuda_graphs: needs a CUDA model.device, got 'cpu'" in message
    config = load_config(write(tmp_path, {"model": {"cuda_graphs": True, "device": "cuda:1"}}))
    assert config.model.cuda_graphs


def test_tensor_parallel_size_is_checked(tmp_path: Path) -> None:
    message = errors_of(tmp_path, {"model": {"tensor_parallel_size": 0}})
    assert "model.tensor_parallel_size: must be >= 1, got 0" in message
    message = errors_of(tmp_path, {"model": {"tensor_parallel_size": 2, "cuda_graphs": True, "device": "cuda"}})
    assert "model.tensor_parallel_size: 2 ranks cannot replay CUDA graphs" in message
    workers = {"cluster": {"instances": [{"name": "p0", "role": "prefill", "host": "127.0.0.1", "port": 9001}]}}
    config = load_config(write(tmp_path, {**workers, "model": {"tensor_parallel_size": 2}}))
    assert config.model.tensor_parallel_size == 2  # worker instances run N ranks
    config = load_config(write(tmp_path, {**workers, "model": {"tensor_parallel_size": 2, "device": "cuda"}}))
    assert config.tensor_parallel_size_of(config.cluster.instances[0]) == 2  # one GPU per rank
    grouped = _grouped([{"name": "pg", "members": ["p0", "p1"], "layer_splits": [10]}])
    config = load_config(write(tmp_path, {**grouped, "model": {"tensor_parallel_size": 2}}))
    assert config.tensor_parallel_size_of(config.instance_named("p1")) == 2  # each stage runs two ranks
    per_instance = {"cluster": {"instances": [
        {"name": "p0", "role": "prefill", "host": "127.0.0.1", "port": 9001, "settings": {"tensor_parallel_size": 2}},
        {"name": "d0", "role": "decode", "host": "127.0.0.1", "port": 9002}]}}
    config = load_config(write(tmp_path, per_instance))
    assert [config.tensor_parallel_size_of(i) for i in config.cluster.instances] == [2, 1]
    assert load_config(write(tmp_path, {"model": {"tensor_parallel_size": 4}})).model.tensor_parallel_size == 4


def test_layerwise_worker_options(tmp_path: Path) -> None:
    message = errors_of(tmp_path, {"worker": {"max_layers_in_flight": 0}, "store": {"numa_node": -2},
                                   "runtime": {"gil_switch_interval_ms": 0}})
    assert "runtime.gil_switch_interval_ms: must be >= 0.01, got 0" in message
    assert "worker.max_layers_in_flight: must be >= 1, got 0" in message
    assert "store.numa_node: must be >= 0, got -2" in message
    message = errors_of(tmp_path, {"worker": {"compute_cpus": [0, 0], "copy_cpus": [-1]}})
    assert "worker.compute_cpus: CPU ids must be distinct and >= 0, got [0, 0]" in message
    assert "worker.copy_cpus: CPU ids must be distinct and >= 0, got [-1]" in message
    config = load_config(write(tmp_path, {"worker": {"compute_cpus": [0], "copy_cpus": [1]}, "store": {"numa_node": 1}}))
    assert (config.worker.compute_cpus, config.worker.copy_cpus, config.store.numa_node) == ([0], [1], 1)


def _grouped(groups: list[dict[str, object]], **worker_settings: object) -> dict[str, object]:
    instances = [{"name": f"p{i}", "role": "prefill", "port": 7000 + i} for i in range(4)]
    instances.append({"name": "d0", "role": "decode", "port": 7010})
    if worker_settings:
        instances[1]["settings"] = worker_settings
    return {"cluster": {"instances": instances, "prefill_groups": groups}}


def test_prefill_groups_are_validated(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, _grouped([{"name": "pg", "members": ["p0", "p1"], "layer_splits": [10]}])))
    group = config.cluster.prefill_groups[0]
    assert config.prefill_group_of("p1") == group and config.prefill_group_of("p2") is None
    assert group.stage_of("p1") == 1 and group.layer_splits == [10]
    message = errors_of(tmp_path, _grouped([
        {"name": "pg", "members": ["p0"]},
        {"name": "pg", "members": ["p1", "d0", "pp2", "p1"], "layer_splits": [3, 2]},
    ]))
    assert "cluster.prefill_groups[0].members: a group needs at least 2 members" in message
    assert "cluster.prefill_groups[1].name: must be non-empty and unique, got 'pg'" in message
    assert "'d0' is a decode instance; members must be prefill instances" in message
    assert "'pp2' is no instance" in message and "(did you mean 'p2'?)" in message
    assert "'p1' is in more than one prefill group (or twice in this one)" in message
    assert "cluster.prefill_groups[1].layer_splits: needs 3 increasing layer indices" in message
    assert "cluster.prefill_groups[0].members: required" not in message


def test_group_members_must_agree_and_not_switch(tmp_path: Path) -> None:
    mixed = errors_of(tmp_path, _grouped([{"name": "pg", "members": ["p0", "p1"]}], cpp_chunk_tokens=512))
    assert "members set different worker.cpp_chunk_tokens [512, 1024]" in mixed
    switching = errors_of(tmp_path, _grouped([{"name": "pg", "members": ["p0", "p1"]}], switchable=True))
    assert "'p1' is switchable; a group member holds only its layers" in switching
    missing = errors_of(tmp_path, {"cluster": {"prefill_groups": [{"members": ["a", "b"]}]}})
    assert "cluster.prefill_groups[0].name: required key is missing" in missing
    assert "worker.cpp_chunk_tokens: must be >= 16" in errors_of(tmp_path, {"worker": {"cpp_chunk_tokens": 8}})
    assert "scheduler.cpp_min_tokens: must be >= 0" in errors_of(tmp_path, {"scheduler": {"cpp_min_tokens": -1}})


def test_nics_are_listed_per_host_and_checked(tmp_path: Path) -> None:
    nics = {"10.0.0.1": [{"name": "eth0", "address": "10.0.0.1/24", "numa_node": 0, "devices": ["cuda:0"]},
                         {"name": "eth1", "address": "10.0.1.1/24"}]}
    config = load_config(write(tmp_path, {"transfer": {"nics": nics}}))
    assert [nic.name for nic in config.transfer.nics["10.0.0.1"]] == ["eth0", "eth1"]
    message = errors_of(tmp_path, {"transfer": {"nics": {"h": [{"name": "eth0", "address": "10.0.0.300"},
                                                               {"name": "eth0", "address": "10.0.0.2"}]}}})
    assert "transfer.nics.h[0]: NIC eth0: address must be an IP address" in message
    assert "two NICs with one name" in message
