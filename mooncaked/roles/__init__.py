"""The roles: each an object with `async start()` / `async stop()`, composed from the other packages.

`make_role(config, instance)` is the explicit table from role name to role class; the modules are imported
only for the role asked for (prefill and decode pull in torch, the store and conductor do not need it). With
`cluster.membership: etcd` the role is wrapped in a `MemberRole` that registers it (member.py), and a prefill or
decode instance with `worker.switchable` becomes a `SwitchableWorkerRole` (worker/switching.py).
"""

from __future__ import annotations

import importlib

from mooncaked.config import Config, InstanceConfig
from mooncaked.roles.member import MemberRole, make_membership
from mooncaked.runtime.lifecycle import Role

ROLE_CLASSES = {
    "conductor": ("mooncaked.roles.conductor.role", "ConductorRole"),
    "prefill": ("mooncaked.roles.worker.prefill.role", "PrefillRole"),
    "decode": ("mooncaked.roles.worker.decode.role", "DecodeRole"),
    "store": ("mooncaked.roles.store", "StoreRole"),
}


SWITCHABLE = ("mooncaked.roles.worker.switching", "SwitchableWorkerRole")


def make_role(config: Config, instance: InstanceConfig) -> Role:
    membership = make_membership(config, instance)
    module_name, class_name = ROLE_CLASSES[instance.role]
    if instance.role in ("prefill", "decode") and config.role_section(instance).switchable:
        module_name, class_name = SWITCHABLE
    role_class = getattr(importlib.import_module(module_name), class_name)
    if instance.role == "store":
        role: Role = role_class(config, instance)
    else:
        role = role_class(config, instance, membership=membership)
    if config.cluster.membership == "static":
        return role
    return MemberRole(role, membership, config.cluster.etcd.drain_notice_s)
