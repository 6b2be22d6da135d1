"""The configuration: one frozen `Config` per process, built once from YAML then `--set` overrides.

The sections live in sections.py and cluster.py, bounds in schema.py, cross-field checks in validate.py,
loading in loading.py; importers use `from mooncaked.config import ...` (the names below).
"""

from mooncaked.config.cluster import ROLES, ClusterSection, EtcdSection, InstanceConfig, PrefillGroupConfig, Role
from mooncaked.config.loading import apply_override, config_as_dict, load_config
from mooncaked.config.schema import ConfigIssue
from mooncaked.config.sections import (
    ROLE_SECTION, ConductorSection, Config, ConfigError, KvSection, ModelSection, PdControllerSection, RpcSection,
    RuntimeSection, SchedulerSection, StoreSection, TransferSection, WorkerSection,
)
from mooncaked.config.validate import validate

__all__ = [
    "ROLES", "Role", "ROLE_SECTION", "ModelSection", "RuntimeSection", "RpcSection", "KvSection",
    "TransferSection", "StoreSection", "SchedulerSection", "ConductorSection", "WorkerSection",
    "InstanceConfig", "EtcdSection", "PrefillGroupConfig", "ClusterSection", "PdControllerSection", "Config",
    "ConfigError", "ConfigIssue", "load_config", "apply_override", "config_as_dict", "validate",
]
