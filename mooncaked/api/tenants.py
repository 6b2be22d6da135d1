"""Tenants: who may call the API, with whom they share KV, and how much of the cluster they may use.

1. `load_tenants(path)` reads `conductor.tenants_file` (YAML, a `tenants:` list) and checks every tenant and
   field; a problem is a `TenantsError` naming the file, the line and the field. `from_api_keys(keys)` makes
   the one tenant of a plain `conductor.api_keys_file` (sharing the common KV namespace, as before tenants).
2. `TenantDirectory.identify(token)` finds the caller's tenant by API key, comparing against every key in
   constant time so timing does not say which key nearly matched.
3. Tenant ids become metric labels, so they come from the file only and are restricted to [A-Za-z0-9._-].
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

KV_MODES = ("private", "shared")
FIELDS = ("id", "api_keys", "kv", "pool_share", "min_pool_share", "requests_per_s", "max_concurrent")
_ID_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
MAX_FILE_BYTES = 4 << 20


class TenantsError(ValueError):
    """A tenants file that cannot be used; the message names the line and field at fault."""


@dataclass(frozen=True)
class Tenant:
    id: str
    api_keys: tuple[str, ...] = field(repr=False)
    kv: str = "private"  # private: KV shared only inside the tenant; shared: the common namespace
    pool_share: float | None = None  # most of each store's DRAM and SSD this tenant may hold
    min_pool_share: float = 0.0  # never evicted below this by other tenants' writes
    requests_per_s: float | None = None  # token bucket; beyond it 429 with Retry-After
    max_concurrent: int | None = None  # requests in flight; beyond it 429 with Retry-After

    @property
    def is_kv_private(self) -> bool:
        return self.kv == "private"


class TenantDirectory:
    """The tenants of one load of the file (immutable); a reload makes a new directory."""

    def __init__(self, tenants: Sequence[Tenant]) -> None:
        self.tenants = {t.id: t for t in tenants}
        self._keys = [(key.encode("utf-8", "surrogatepass"), t) for t in tenants for key in t.api_keys]

    @property
    def is_open(self) -> bool:
        """No tenant configured: every caller is served, as the anonymous tenant."""
        return not self._keys

    def identify(self, token: str) -> Tenant | None:
        given = token.encode("utf-8", "surrogatepass")
        found: Tenant | None = None
        for key, tenant in self._keys:  # every key compared: the time does not depend on which one matches
            if hmac.compare_digest(given, key):
                found = tenant
        return found


def from_api_keys(keys: Iterable[str]) -> TenantDirectory:
    keys = tuple(keys)
    return TenantDirectory([Tenant("default", keys, kv="shared")] if keys else [])


def load_tenants(path: str | Path) -> TenantDirectory:
    where = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise TenantsError(f"{where}: cannot read it: {exc.strerror}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise TenantsError(f"{where}: {len(raw)} bytes is over the {MAX_FILE_BYTES}-byte limit")
    try:
        root = yaml.compose(raw.decode("utf-8"), Loader=yaml.SafeLoader)
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise TenantsError(f"{where}: not valid YAML: {exc}") from None
    return TenantDirectory(_tenants(root, where))


def _tenants(root: Any, where: str) -> list[Tenant]:
    if not isinstance(root, yaml.MappingNode) or [k.value for k, _ in root.value] != ["tenants"]:
        raise TenantsError(f"{where}:{_line(root)}: the file must be a mapping with one key, `tenants`")
    items = root.value[0][1]
    if not isinstance(items, yaml.SequenceNode) or not items.value:
        raise TenantsError(f"{where}:{_line(items)}: tenants: expected a non-empty list of tenants")
    tenants = [_tenant(node, where) for node in items.value]
    _check_unique(tenants, items.value, where)
    total_min = sum(t.min_pool_share for t in tenants)
    if total_min > 1.0:
        raise TenantsError(f"{where}: min_pool_share adds up to {total_min:g} over all tenants; it must be <= 1")
    return tenants


def _tenant(node: Any, where: str) -> Tenant:
    if not isinstance(node, yaml.MappingNode):
        raise TenantsError(f"{where}:{_line(node)}: a tenant must be a mapping of {', '.join(FIELDS)}")
    values: dict[str, Any] = {}
    for key_node, value_node in node.value:
        name = key_node.value if isinstance(key_node, yaml.ScalarNode) else "?"
        if name not in FIELDS:
            raise TenantsError(f"{where}:{_line(key_node)}: {name!r} is not a tenant field; use {', '.join(FIELDS)}")
        if name in values:
            raise TenantsError(f"{where}:{_line(key_node)}: {name} given twice")
        values[name] = _field(name, value_node, where)
    if "id" not in values or "api_keys" not in values:
        raise TenantsError(f"{where}:{_line(node)}: a tenant needs an id and api_keys")
    tenant = Tenant(**values)
    if tenant.pool_share is not None and tenant.min_pool_share > tenant.pool_share:
        raise TenantsError(f"{where}:{_line(node)}: tenant {tenant.id}: min_pool_share {tenant.min_pool_share:g} "
                           f"is above its pool_share {tenant.pool_share:g}")
    return tenant


def _field(name: str, node: Any, where: str) -> Any:
    at = f"{where}:{_line(node)}: {name}"
    if name == "api_keys":
        if not isinstance(node, yaml.SequenceNode) or not node.value:
            raise TenantsError(f"{at}: expected a non-empty list of keys")
        keys = tuple(_scalar(item, f"{at}", str) for item in node.value)
        if any(not key.strip() or len(key) > 4096 for key in keys):
            raise TenantsError(f"{at}: every key must be a non-blank string of at most 4096 characters")
        return keys
    if name in ("id", "kv"):
        value = _scalar(node, at, str)
        if name == "id" and not _ID_PATTERN.match(value):
            raise TenantsError(f"{at}: {value!r}: use 1-64 of A-Z a-z 0-9 . _ -")
        if name == "kv" and value not in KV_MODES:
            raise TenantsError(f"{at}: {value!r}: use private or shared")
        return value
    if name == "max_concurrent":
        value = _scalar(node, at, int)
        if value < 1:
            raise TenantsError(f"{at}: must be at least 1, got {value}")
        return value
    number = float(_scalar(node, at, float))
    lower_ok = number >= 0 if name == "min_pool_share" else number > 0
    if not lower_ok or (name != "requests_per_s" and number > 1) or number != number or number == float("inf"):
        bounds = "in [0, 1]" if name == "min_pool_share" else "in (0, 1]" if name == "pool_share" else "> 0"
        raise TenantsError(f"{at}: must be a number {bounds}, got {node.value!r}")
    return number


def _scalar(node: Any, at: str, kind: type) -> Any:
    if not isinstance(node, yaml.ScalarNode):
        raise TenantsError(f"{at}: expected a {kind.__name__}, got a {type(node).__name__.removesuffix('Node')}")
    loader = yaml.SafeLoader("")
    try:
        value = loader.construct_object(node, deep=True)
    except yaml.YAMLError as exc:
        raise TenantsError(f"{at}: {exc}") from None
    finally:
        loader.dispose()
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if type(value) is not kind:
        raise TenantsError(f"{at}: expected a {kind.__name__}, got {node.value!r}")
    return value


def _check_unique(tenants: Sequence[Tenant], nodes: Sequence[Any], where: str) -> None:
    seen_ids: set[str] = set()
    seen_keys: set[str] = set()
    for tenant, node in zip(tenants, nodes):
        if tenant.id in seen_ids:
            raise TenantsError(f"{where}:{_line(node)}: id: {tenant.id!r} names two tenants")
        if seen_keys & set(tenant.api_keys):
            raise TenantsError(f"{where}:{_line(node)}: api_keys: tenant {tenant.id} reuses another tenant's key")
        seen_ids.add(tenant.id)
        seen_keys.update(tenant.api_keys)


def _line(node: Any) -> int:
    mark = getattr(node, "start_mark", None)
    return mark.line + 1 if mark is not None else 1
