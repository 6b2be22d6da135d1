"""The conductor's tenants: read at start, reloaded on SIGHUP without dropping a request.

1. `make_gate(config, metrics)` reads `conductor.tenants_file` (or a plain `conductor.api_keys_file`, one
   tenant) into the HTTP layer's `TenantGate`; a bad file at start is a configuration error (exit 2).
2. `reload(gate, config)` reads the file again: a good one replaces the tenants between requests; a bad one
   keeps the old tenants and logs why.
"""

from __future__ import annotations

import logging
from pathlib import Path

from mooncaked.api.tenant_gate import TenantGate
from mooncaked.api.tenants import TenantDirectory, TenantsError, from_api_keys, load_tenants
from mooncaked.config import Config, ConfigError
from mooncaked.config.schema import ConfigIssue
from mooncaked.runtime.metrics import Metrics

logger = logging.getLogger(__name__)


def read_directory(config: Config) -> TenantDirectory:
    """The tenants the config names; raises TenantsError (a bad tenants file) or ConfigError (bad keys file)."""
    section = config.conductor
    if section.tenants_file is not None:
        return load_tenants(section.tenants_file)
    return from_api_keys(read_api_keys(section.api_keys_file))


def make_gate(config: Config, metrics: Metrics) -> TenantGate:
    try:
        directory = read_directory(config)
    except TenantsError as exc:
        raise ConfigError([ConfigIssue("conductor.tenants_file", str(exc))]) from None
    if directory.tenants:
        logger.info("%d tenant(s): %s", len(directory.tenants), ", ".join(sorted(directory.tenants)))
    return TenantGate(directory, on_rejected=metrics.tenants.observe_rejection)


def reload(gate: TenantGate, config: Config) -> bool:
    """Re-read the tenants (SIGHUP); False, with the old tenants kept and the reason logged, when it fails."""
    try:
        directory = read_directory(config)
    except (TenantsError, ConfigError) as exc:
        logger.error("tenants not reloaded, keeping the %d current ones: %s", len(gate.directory.tenants), exc)
        return False
    gate.reload(directory)
    logger.info("tenants reloaded: %s", ", ".join(sorted(directory.tenants)) or "none (open)")
    return True


def read_api_keys(path: str | None) -> frozenset[str]:
    """One key per line; blank lines and lines starting with # are ignored."""
    if path is None:
        return frozenset()
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ConfigError([ConfigIssue("conductor.api_keys_file", f"cannot read {path}: {exc.strerror}")]) from None
    keys = frozenset(line.strip() for line in lines if line.strip() and not line.strip().startswith("#"))
    if not keys:
        raise ConfigError([ConfigIssue("conductor.api_keys_file", f"{path} holds no key")])
    return keys
