"""`--role all`: one child process per instance configured for this host, supervised.

1. start(): pick this host's instances; start them in dependency order (stores, then prefill/decode, then
   conductors), each a `mooncaked --role R --instance NAME` child with its own NOTIFY_SOCKET, and wait for each
   tier's READY=1 (with a deadline) before starting the next, so peers find each other up.
2. A monitor task restarts a child that exits while we are running, with exponential backoff (reset once the child
   has stayed up for `stable_after_s`).
3. stop(): SIGTERM to the children in reverse start order (conductors first, so no new work arrives), wait for them
   up to the drain deadline plus a margin, SIGKILL what is left; then the monitor task is cancelled and awaited.
   Children also get PR_SET_PDEATHSIG, so even a SIGKILLed supervisor leaves no child behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field

from mooncaked.config import Config, InstanceConfig

logger = logging.getLogger(__name__)

_START_TIERS = (("store",), ("prefill", "decode"), ("conductor",))
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def is_local_host(host: str) -> bool:
    """Whether `host` names this machine (loopback range, its hostname or one of its addresses)."""
    if host in ("localhost", "::1") or host.startswith("127."):
        return True
    names = {socket.gethostname(), socket.getfqdn()}
    if host in names:
        return True
    with contextlib.suppress(OSError):
        return host in {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    return False


@dataclass
class Child:
    """One supervised process; owned by the Supervisor."""

    instance: InstanceConfig
    process: asyncio.subprocess.Process | None = None
    notify_path: str = ""
    notify_sock: socket.socket | None = None
    started_at: float = 0.0
    num_restarts: int = 0
    ready: asyncio.Event = field(default_factory=asyncio.Event)


class Supervisor:
    """Owns the child processes and their notify sockets."""

    name = "supervisor"

    def __init__(self, config: Config, *, config_path: str, overrides: list[str],
                 ready_timeout_s: float = 120.0, max_backoff_s: float = 30.0, stable_after_s: float = 60.0) -> None:
        self.config = config
        self.config_path = config_path
        self.overrides = list(overrides)
        self.ready_timeout_s = ready_timeout_s
        self.max_backoff_s = max_backoff_s
        self.stable_after_s = stable_after_s
        self.children = [Child(i) for i in config.cluster.instances if is_local_host(i.host)]
        self._is_stopping = False
        self._monitors: list[asyncio.Task[None]] = []
        self._tmpdir = tempfile.mkdtemp(prefix="mooncaked-supervisor-")

    async def start(self) -> None:
        if not self.children:
            raise RuntimeError("no instance in cluster.instances is configured for this host")
        for tier in _START_TIERS:
            tier_children = [c for c in self.children if c.instance.role in tier]
            for child in tier_children:
                await self._spawn(child)
                self._monitors.append(asyncio.create_task(self._monitor(child), name=f"monitor-{child.instance.name}"))
            await self._wait_ready(tier_children)

    async def _wait_ready(self, children: list[Child]) -> None:
        waits = [asyncio.wait_for(c.ready.wait(), self.ready_timeout_s) for c in children]
        try:
            await asyncio.gather(*waits)
        except asyncio.TimeoutError:
            late = [c.instance.name for c in children if not c.ready.is_set()]
            raise RuntimeError(f"instances {late} did not become ready within {self.ready_timeout_s}s") from None

    async def _spawn(self, child: Child) -> None:
        self._open_notify_socket(child)
        command = [sys.executable, "-m", "mooncaked", "--role", child.instance.role, "--config", self.config_path,
                   "--instance", child.instance.name]
        for override in self.overrides:
            command += ["--set", override]
        env = {**os.environ, "NOTIFY_SOCKET": child.notify_path}
        env.pop("WATCHDOG_USEC", None)
        child.ready.clear()
        child.process = await asyncio.create_subprocess_exec(*command, env=env, preexec_fn=_die_with_parent)
        child.started_at = time.monotonic()
        logger.info("started %s (%s) pid %d", child.instance.name, child.instance.role, child.process.pid)

    def _open_notify_socket(self, child: Child) -> None:
        if child.notify_sock is not None:
            return
        child.notify_path = os.path.join(self._tmpdir, f"{child.instance.name}.sock")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(child.notify_path)
        sock.setblocking(False)
        child.notify_sock = sock
        asyncio.get_running_loop().add_reader(sock.fileno(), self._on_notify, child)

    def _on_notify(self, child: Child) -> None:
        assert child.notify_sock is not None
        with contextlib.suppress(BlockingIOError):
            while True:
                message = child.notify_sock.recv(4096).decode(errors="replace")
                if "READY=1" in message.splitlines():
                    child.ready.set()

    async def _monitor(self, child: Child) -> None:
        backoff_s = 1.0
        while True:
            assert child.process is not None
            code = await child.process.wait()
            if self._is_stopping:
                return
            uptime_s = time.monotonic() - child.started_at
            if uptime_s >= self.stable_after_s:
                backoff_s = 1.0
            logger.warning("%s exited with code %s after %.1fs; restarting in %.1fs",
                           child.instance.name, code, uptime_s, backoff_s)
            await asyncio.sleep(backoff_s)
            if self._is_stopping:
                return
            backoff_s = min(backoff_s * 2, self.max_backoff_s)
            child.num_restarts += 1
            await self._spawn(child)

    async def stop(self) -> None:
        self._is_stopping = True
        deadline_s = self.config.runtime.drain_timeout_s + 10.0
        for tier in reversed(_START_TIERS):
            tier_children = [c for c in self.children if c.instance.role in tier]
            await asyncio.gather(*(self._terminate(c, deadline_s) for c in tier_children))
        for task in self._monitors:
            task.cancel()
        for task in self._monitors:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._close_notify_sockets()

    async def _terminate(self, child: Child, deadline_s: float) -> None:
        process = child.process
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), deadline_s)
        except asyncio.TimeoutError:
            logger.warning("%s did not stop within %.0fs; killing it", child.instance.name, deadline_s)
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()

    def _close_notify_sockets(self) -> None:
        loop = asyncio.get_running_loop()
        for child in self.children:
            if child.notify_sock is not None:
                loop.remove_reader(child.notify_sock.fileno())
                child.notify_sock.close()
                child.notify_sock = None
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(child.notify_path)
        with contextlib.suppress(OSError):
            os.rmdir(self._tmpdir)
