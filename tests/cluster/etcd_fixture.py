"""A real etcd on loopback for tests: the `etcd` fixture starts one per test and always stops it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from mooncaked.bench.etcd_server import MISSING_REASON, EtcdServer, etcd_binary

needs_etcd = pytest.mark.skipif(etcd_binary() is None, reason=MISSING_REASON)


@pytest.fixture
async def etcd(tmp_path: Path) -> AsyncIterator[EtcdServer]:
    server = EtcdServer(tmp_path / "etcd")
    await server.start()
    try:
        yield server
    finally:
        server.kill()
