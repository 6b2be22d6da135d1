"""The roles: each an object with `async start()` / `async stop()`, composed from the other packages.

`make_role(config, instance)` is the explicit table from role name to role class; the modules are imported
only for the role asked for (prefill and decode pull in torch, the store and conductor do not need it).
"""

from __future__ import annotations

import importlib

from mooncaked.config import Config, InstanceConfig
from mooncaked.lifecycle import Role

ROLE_CLASSES = {
    "conductor": ("mooncaked.roles.conductor.role", "ConductorRole"),
    "prefill": ("mooncaked.roles.worker.prefill", "PrefillRole"),
    "decode": ("mooncaked.roles.worker.decode", "DecodeRole"),
    "store": ("mooncaked.roles.store", "StoreRole"),
}


def make_role(config: Config, instance: InstanceConfig) -> Role:
    module_name, class_name = ROLE_CLASSES[instance.role]
    role_class = getattr(importlib.import_module(module_name), class_name)
    role: Role = role_class(config, instance)
    return role
