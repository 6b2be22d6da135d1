"""How this process reaches etcd securely, from `cluster.etcd`: TLS and user credentials.

1. `etcd_ssl_context(section)` (https:// endpoints): verify etcd's certificate against `ca_file` (else the system's
   CAs) and present `cert_file`/`key_file` when set (etcd's --client-cert-auth).
2. `etcd_auth(section)`: `username` with the password read from `password_file` (stripped of surrounding
   whitespace; never logged), or None.
Both run once, when the membership is built at start; a file that cannot be used is a ConfigError naming its key
(the process exits 2: a restart cannot fix it).
"""

from __future__ import annotations

import logging
import ssl
from pathlib import Path

from mooncaked.cluster.etcd_client import EtcdAuth
from mooncaked.config import ConfigError
from mooncaked.config.cluster import EtcdSection
from mooncaked.config.schema import ConfigIssue

logger = logging.getLogger(__name__)


def etcd_ssl_context(section: EtcdSection) -> ssl.SSLContext | None:
    """The TLS context for https:// endpoints; None when no endpoint is https://."""
    if not any(endpoint.startswith("https://") for endpoint in section.endpoints):
        return None
    try:
        context = ssl.create_default_context(cafile=section.ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError([ConfigIssue("cluster.etcd.ca_file", f"cannot load {section.ca_file}: {exc}")]) from None
    if section.cert_file is not None:
        try:
            context.load_cert_chain(section.cert_file, section.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError([ConfigIssue("cluster.etcd.cert_file", f"cannot load {section.cert_file} with "
                                           f"{section.key_file}: {exc}")]) from None
    return context


def etcd_auth(section: EtcdSection) -> EtcdAuth | None:
    """The user credentials for etcd's authentication, or None without `username`."""
    if section.username is None or section.password_file is None:
        return None
    try:
        password = Path(section.password_file).read_text().strip()
    except OSError as exc:
        raise ConfigError([ConfigIssue("cluster.etcd.password_file",
                                       f"cannot read {section.password_file}: {exc.strerror}")]) from None
    if not password:
        raise ConfigError([ConfigIssue("cluster.etcd.password_file", f"{section.password_file} is empty")])
    if not all(endpoint.startswith("https://") for endpoint in section.endpoints):
        logger.warning("etcd: the password of %r goes to plain http:// endpoints; use https:// ones",
                       section.username)
    return EtcdAuth(section.username, password)
