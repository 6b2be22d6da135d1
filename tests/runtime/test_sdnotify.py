"""sd_notify against a fake NOTIFY_SOCKET, and the watchdog interval."""

from __future__ import annotations

import socket
from pathlib import Path

from mooncaked.runtime.lifecycle import watchdog_interval
from mooncaked.runtime.sdnotify import Notifier


def test_notifier_sends_datagrams(tmp_path: Path) -> None:
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(path)
        server.settimeout(5)
        notifier = Notifier(path)
        assert notifier.ready() and notifier.watchdog() and notifier.stopping()
        assert [server.recv(100) for _ in range(3)] == [b"READY=1", b"WATCHDOG=1", b"STOPPING=1"]


def test_abstract_socket() -> None:
    name = f"mooncaked-test-{id(object())}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind("\0" + name)
        server.settimeout(5)
        assert Notifier("@" + name).ready()
        assert server.recv(100) == b"READY=1"


def test_disabled_and_broken_socket(tmp_path: Path) -> None:
    assert not Notifier(None).ready()
    assert not Notifier(str(tmp_path / "missing.sock")).ready()


def test_watchdog_interval() -> None:
    assert watchdog_interval("30000000") == 15.0
    assert watchdog_interval(None) is None
    assert watchdog_interval("abc") is None
    assert watchdog_interval("0") is None
