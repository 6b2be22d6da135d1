"""Membership against a real etcd that demands TLS with client certificates, or user authentication: with the
`cluster.etcd` options an instance registers and lists; without them it is refused and says so."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from mooncaked.bench.etcd_server import EtcdServer, EtcdTls
from mooncaked.cluster.etcd_client import EtcdClient
from mooncaked.cluster.etcd_membership import EtcdMembership
from mooncaked.config import Config, ConfigError, load_config
from tests.cluster.etcd_fixture import etcd, needs_etcd  # noqa: F401
from tests.cluster.test_etcd_membership import wait_until

pytestmark = needs_etcd
PASSWORD = "not in any log"


def make_certificates(directory: Path) -> EtcdTls:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, with the openssl command."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    directory.mkdir()

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1", "-subj", "/CN=test-ca")
    # etcd's JSON gateway reaches its own gRPC server with the server certificate: it needs clientAuth too
    for name, usage in (("server", "serverAuth,clientAuth"), ("client", "clientAuth")):
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        (directory / f"{name}.ext").write_text(f"subjectAltName=IP:127.0.0.1\nextendedKeyUsage={usage}\n")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.crt", "-days", "1", "-extfile", f"{name}.ext")
    return EtcdTls(directory / "server.crt", directory / "server.key", directory / "ca.crt",
                   directory / "client.crt", directory / "client.key")


def membership_config(tmp_path: Path, endpoint: str, **etcd_options: Any) -> Config:
    data = {"cluster": {"id": "secure", "membership": "etcd",
                        "instances": [{"name": "s0", "role": "store", "host": "127.0.0.1", "port": 7001}],
                        "etcd": {"endpoints": [endpoint], "lease_ttl_s": 2, "call_timeout_s": 2.0,
                                 "min_backoff_s": 0.05, "max_backoff_s": 0.3, "startup_timeout_s": 1.0,
                                 **etcd_options}}}
    path = tmp_path / f"etcd-{len(list(tmp_path.glob('etcd-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


async def registered(config: Config) -> tuple[bool, str]:
    """Whether the instance registered and listed itself, and the last error it reported."""
    membership = EtcdMembership(config, config.instance_named("s0"))
    await membership.start()
    try:
        return "s0" in membership.members() and membership.status().is_connected, membership.status().last_error
    finally:
        await membership.stop()


@pytest.fixture
async def tls_etcd(tmp_path: Path) -> AsyncIterator[EtcdServer]:
    server = EtcdServer(tmp_path / "etcd-tls", tls=make_certificates(tmp_path / "certs"))
    await server.start()
    try:
        yield server
    finally:
        server.kill()


async def test_tls_with_a_client_certificate(tmp_path: Path, tls_etcd: EtcdServer) -> None:
    tls = tls_etcd.tls
    assert tls is not None and tls_etcd.endpoint.startswith("https://")
    config = membership_config(tmp_path, tls_etcd.endpoint, ca_file=str(tls.ca_file),
                               cert_file=str(tls.client_cert_file), key_file=str(tls.client_key_file))
    assert await registered(config) == (True, "")
    without_certificate = membership_config(tmp_path, tls_etcd.endpoint, ca_file=str(tls.ca_file))
    is_registered, error = await registered(without_certificate)
    assert not is_registered and "etcd unreachable" in error
    unverified = membership_config(tmp_path, tls_etcd.endpoint)  # etcd's CA is not among the system's
    is_registered, error = await registered(unverified)
    assert not is_registered and "certificate" in error.lower()


async def test_user_authentication(tmp_path: Path, etcd: EtcdServer, caplog: pytest.LogCaptureFixture) -> None:
    admin = EtcdClient([etcd.endpoint], 2.0)
    try:
        await admin.call("/v3/auth/user/add", {"name": "root", "password": PASSWORD})
        await admin.call("/v3/auth/user/grant", {"user": "root", "role": "root"})
        await admin.call("/v3/auth/enable", {})
    finally:
        await admin.close()
    password_file = tmp_path / "etcd-password"
    password_file.write_text(PASSWORD + "\n")
    config = membership_config(tmp_path, etcd.endpoint, username="root", password_file=str(password_file))
    assert await registered(config) == (True, "")
    is_registered, error = await registered(membership_config(tmp_path, etcd.endpoint))
    assert not is_registered and "user name is empty" in error
    (tmp_path / "wrong").write_text("wrong")
    is_registered, error = await registered(membership_config(tmp_path, etcd.endpoint, username="root",
                                                              password_file=str(tmp_path / "wrong")))
    assert not is_registered and "authentication failed" in error
    assert PASSWORD not in caplog.text


def test_bad_security_options_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cluster.etcd.cert_file: set cert_file and key_file together"):
        membership_config(tmp_path, "https://127.0.0.1:1", cert_file="c.pem")
    with pytest.raises(ConfigError, match="cluster.etcd.ca_file: needs https:// endpoints"):
        membership_config(tmp_path, "http://127.0.0.1:1", ca_file="ca.pem")
    with pytest.raises(ConfigError, match="cluster.etcd.username: set username and password_file together"):
        membership_config(tmp_path, "http://127.0.0.1:1", username="root")
    config = membership_config(tmp_path, "http://127.0.0.1:1", username="root",
                               password_file=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="cluster.etcd.password_file: cannot read"):
        EtcdMembership(config, config.instance_named("s0"))
