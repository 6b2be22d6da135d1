"""Loading the one frozen configuration of a process.

1. `load_config(path, overrides)` reads YAML, applies `--set key.path=value` overrides to the raw data, then
   builds the frozen sections (sections.py, cluster.py) and checks them across fields
   (validate.py), collecting every error (`ConfigError` lists them all).
2. `Config` (sections.py) finds this process's entry (`instance_for`) and its role's section with the
   instance's own overrides applied (`role_section`).

Every option is documented in config.example.yaml; tests/config/test_config.py checks that the file loads and names
every key. Derived facts (KV block counts, EOS ids) are not config: they live with the components.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from mooncaked.config.schema import ConfigIssue, build
from mooncaked.config.sections import Config, ConfigError
from mooncaked.config.validate import validate


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


def config_as_dict(config: Config) -> dict[str, Any]:
    """Plain data for printing (`check-config`) and for handing to child processes."""
    return dataclasses.asdict(config)
