"""One etcd server on loopback for tests and benchmarks (Debian's etcd-server; `make debs` installs it).

1. `EtcdServer(data_dir)` picks free client and peer ports on 127.0.0.1; `await start(timeout_s)` runs
   `etcd` with its data in `data_dir` and waits until `/version` answers (or raises with its log's tail).
2. `await stop()` sends SIGTERM and waits; `kill()` sends SIGKILL. Either may be followed by `start()` again:
   the same ports and data directory, so keys and leases survive (an outage, not a new cluster).
3. `etcd_binary()` is the path of `etcd`, or None when it is not installed (callers skip with that reason).
4. With `tls` (PEM files: its certificate and key, and the CA its clients' certificates must chain to) it serves
   https:// only and asks every client for a certificate (--client-cert-auth).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import ssl
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from mooncaked.bench.cluster import free_port

MISSING_REASON = "etcd is not installed (Debian's etcd-server: `make debs`)"


def etcd_binary() -> str | None:
    return shutil.which("etcd") or (str(Path("/usr/bin/etcd")) if Path("/usr/bin/etcd").exists() else None)


@dataclass(frozen=True)
class EtcdTls:
    """PEM files of a TLS etcd: its certificate and key, and the CA its clients' certificates chain to; a client
    certificate and key signed by that CA for the server's own readiness probe."""

    cert_file: Path
    key_file: Path
    ca_file: Path
    client_cert_file: Path
    client_key_file: Path


class EtcdServer:
    """Owns one etcd process, its ports and its data directory."""

    def __init__(self, data_dir: Path, host: str = "127.0.0.1", tls: EtcdTls | None = None) -> None:
        self.data_dir = data_dir
        self.host = host
        self.tls = tls
        self.client_port = free_port(host)
        self.peer_port = free_port(host)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.client_port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir.parent / f"{self.data_dir.name}.log"

    async def start(self, timeout_s: float = 20.0) -> None:
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError(MISSING_REASON)
        peer = f"http://{self.host}:{self.peer_port}"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [binary, "--name", "mooncaked-test", "--data-dir", str(self.data_dir),
                 "--listen-client-urls", self.endpoint, "--advertise-client-urls", self.endpoint,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"mooncaked-test={peer}", "--log-level", "warn", *self._tls_flags()],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        try:
            await self._wait_ready(timeout_s)
        except BaseException:
            self.kill()
            raise

    def _tls_flags(self) -> list[str]:
        if self.tls is None:
            return []
        return ["--cert-file", str(self.tls.cert_file), "--key-file", str(self.tls.key_file),
                "--trusted-ca-file", str(self.tls.ca_file), "--client-cert-auth"]

    def _probe_ssl(self) -> ssl.SSLContext | bool:
        if self.tls is None:
            return True
        context = ssl.create_default_context(cafile=str(self.tls.ca_file))
        context.load_cert_chain(str(self.tls.client_cert_file), str(self.tls.client_key_file))
        return context

    async def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self._probe_ssl())) as session:
            while time.monotonic() < deadline:
                assert self.process is not None
                if self.process.poll() is not None:
                    raise RuntimeError(f"etcd exited with code {self.process.returncode}:\n{self.log_tail()}")
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with session.post(self.endpoint + "/v3/kv/range", json={"key": "AA=="},
                                            timeout=aiohttp.ClientTimeout(total=1.0)) as response:
                        if response.status == 200:
                            return
                await asyncio.sleep(0.1)
        raise RuntimeError(f"etcd did not answer within {timeout_s:.0f} s:\n{self.log_tail()}")

    async def stop(self, timeout_s: float = 10.0) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while process.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if process.poll() is None:
            process.kill()
            process.wait(timeout=timeout_s)

    def kill(self) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(timeout=10.0)

    def log_tail(self, num_chars: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-num_chars:]
        return ""
