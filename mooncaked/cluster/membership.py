"""Who is in the cluster, behind one small interface (docs/design.md section 11).

1. `roles.member.make_membership(config, me)` builds the source `cluster.membership` names: `StaticMembership` (the
   YAML's `cluster.instances`, every one ready, never changing) or `EtcdMembership` (etcd_membership.py: leases,
   watches, retries).
2. Readers call `members()` for the current records and `add_listener(fn)` to hear each change as
   `fn(name, old, new)` (old None: joined; new None: left). Listeners run on the event loop and must not block.
3. The instance itself calls `set_state()` as it starts, serves, drains or switches role; `status()` tells
   `/health` and `/v1/cluster` whether the source is reachable.

A `MemberRecord` is what an instance publishes about itself: enough for a peer to connect to it and to place
work on it without reading its config file.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from mooncaked.config import ROLES, Config, InstanceConfig

logger = logging.getLogger(__name__)

MemberState = Literal["starting", "ready", "draining"]
MEMBER_STATES = ("starting", "ready", "draining")
RECORD_VERSION = 1
# Worker settings a conductor needs to place work on an instance it knows only from its record.
PUBLISHED_SETTINGS = ("max_batch_size", "num_kv_pages", "inline_prefill_max_tokens")

Listener = Callable[[str, "MemberRecord | None", "MemberRecord | None"], None]


@dataclass(frozen=True)
class MemberRecord:
    """One instance as the cluster sees it (the value under `<prefix>/<cluster id>/instances/<name>`)."""

    name: str
    role: str
    host: str
    port: int
    rpc_port: int = 0
    data_port: int = 0
    metrics_port: int = 0
    model: str = ""
    state: str = "ready"
    is_switchable: bool = False
    settings: dict[str, Any] = field(default_factory=dict)
    incarnation: int = 0  # changes when the process restarts

    @classmethod
    def for_instance(cls, config: Config, instance: InstanceConfig, state: MemberState) -> MemberRecord:
        settings: dict[str, Any] = {}
        is_switchable = False
        if instance.role in ("prefill", "decode"):
            section = config.role_section(instance)
            settings = {key: getattr(section, key) for key in PUBLISHED_SETTINGS
                        if getattr(section, key) is not None}  # num_kv_pages: None when sized from a budget
            is_switchable = bool(section.switchable)
        return cls(instance.name, instance.role, instance.host, instance.port, instance.rpc_port,
                   instance.data_port, instance.metrics_port, config.model.name, state, is_switchable, settings,
                   time.time_ns())

    def to_json(self) -> bytes:
        return json.dumps({"version": RECORD_VERSION, **dataclasses.asdict(self)}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> MemberRecord:
        """Parse a published record; ValueError naming what is wrong."""
        try:
            raw = json.loads(data)
        except (UnicodeDecodeError, ValueError) as exc:
            raise ValueError(f"member record is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("member record is not a JSON object")
        if raw.pop("version", None) != RECORD_VERSION:
            raise ValueError(f"member record version is not {RECORD_VERSION}")
        names = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(raw) - set(names)
        if unknown:
            raise ValueError(f"member record has unknown fields {sorted(unknown)}")
        missing = [n for n, f in names.items() if n not in raw and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ValueError(f"member record lacks fields {missing}")
        record = cls(**raw)
        record.check()
        return record

    def check(self) -> None:
        """ValueError unless every field has the type and range a peer relies on."""
        for name, kind in (("name", str), ("role", str), ("host", str), ("model", str), ("state", str)):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"member record field {name!r} must be a string")
        if not self.name or self.role not in ROLES or self.state not in MEMBER_STATES:
            raise ValueError(f"member record {self.name!r}: bad name, role {self.role!r} or state {self.state!r}")
        for name in ("port", "rpc_port", "data_port", "metrics_port"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 65535:
                raise ValueError(f"member record {self.name!r}: {name} must be a port number, got {value!r}")
        if not isinstance(self.is_switchable, bool) or not isinstance(self.incarnation, int):
            raise ValueError(f"member record {self.name!r}: is_switchable must be a bool, incarnation an int")
        if not isinstance(self.settings, dict) or set(self.settings) - set(PUBLISHED_SETTINGS) or any(
                not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in self.settings.values()):
            raise ValueError(f"member record {self.name!r}: settings must map {list(PUBLISHED_SETTINGS)} "
                             "to non-negative integers")

    def instance_config(self) -> InstanceConfig:
        """The record as a config entry, so code written for `cluster.instances` serves it unchanged."""
        return InstanceConfig(self.name, self.role, self.host, self.port, self.rpc_port,  # type: ignore[arg-type]
                              self.data_port, self.metrics_port, [], dict(self.settings))

    @property
    def is_ready(self) -> bool:
        return self.state == "ready"


@dataclass(frozen=True)
class MembershipStatus:
    backend: str
    is_connected: bool
    last_error: str = ""
    disconnected_for_s: float = 0.0
    num_members: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Membership(Protocol):
    """What roles read and write; see the module docstring."""

    def members(self) -> dict[str, MemberRecord]: ...

    def add_listener(self, listener: Listener) -> None: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def set_state(self, state: MemberState, role: str | None = None) -> None: ...

    def status(self) -> MembershipStatus: ...


def store_on_host(membership: Membership, host: str) -> MemberRecord | None:
    """The store on `host` (the one a worker there maps), or None."""
    return next((r for r in membership.members().values() if r.role == "store" and r.host == host), None)


class MemberTable:
    """Owns the records last seen and the listeners; applies a new snapshot or one change as diffs."""

    def __init__(self) -> None:
        self.records: dict[str, MemberRecord] = {}
        self._listeners: list[Listener] = []

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def apply(self, name: str, new: MemberRecord | None) -> None:
        old = self.records.get(name)
        if old == new:
            return
        if new is None:
            del self.records[name]
        else:
            self.records[name] = new
        for listener in list(self._listeners):
            try:
                listener(name, old, new)
            except Exception:
                logger.exception("membership listener failed on %s", name)

    def replace_all(self, records: dict[str, MemberRecord]) -> None:
        for name in [n for n in self.records if n not in records]:
            self.apply(name, None)
        for name, record in records.items():
            self.apply(name, record)


class StaticMembership:
    """`cluster.instances` as they are written. Owns its table; this instance's own state changes locally only."""

    def __init__(self, config: Config, me: InstanceConfig | None = None) -> None:
        self.table = MemberTable()
        self.me = me
        for instance in config.cluster.instances:
            self.table.records[instance.name] = MemberRecord.for_instance(config, instance, "ready")

    def members(self) -> dict[str, MemberRecord]:
        return dict(self.table.records)

    def add_listener(self, listener: Listener) -> None:
        self.table.add_listener(listener)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def set_state(self, state: MemberState, role: str | None = None) -> None:
        if self.me is None:
            return
        record = self.table.records[self.me.name]
        self.table.apply(self.me.name, dataclasses.replace(record, state=state, role=role or record.role))

    def status(self) -> MembershipStatus:
        return MembershipStatus("static", True, num_members=len(self.table.records))

