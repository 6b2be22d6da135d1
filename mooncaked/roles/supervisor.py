"""`--role all`: one child process per instance configured for this host, supervised.

1. start(): pick this host's instances; start them in dependency order (stores, then prefill/decode, then
   conductors), each a `mooncaked --role R --instance NAME` child with its own NOTIFY_SOCKET, and wait for each
   tier's READY=1 (with a deadline) before starting the next, so peers find each other up.
2. A monitor task per child (supervised: an unexpected exception, say a failed spawn, is logged and the monitor
   starts again; runtime/supervised.py) watches it exit while we are running:
   - exit status 2 (EXIT_FATAL: a configuration or load error, named in the child's sd_notify STATUS=) is not
     restarted: the supervisor records it in `fatal_error`, logs it and sets `stop_requested`, so `--role all`
     stops every instance and exits 2 (during start-up, start() raises it at once instead of waiting for ready);
   - any other exit is a crash: restarted with exponential backoff (reset once the child has stayed up for
     `stable_after_s`); CRASH_LOOP_CRASHES crashes within CRASH_LOOP_WINDOW_S are logged as a crash loop.
3. stop(): SIGTERM to the children in reverse start order (conductors first, so no new work arrives), wait for them
   up to twice the drain deadline (a store's RPC drain, then its DRAM written to SSD) plus a margin, SIGKILL what
   is left; then the monitor task is cancelled and awaited.
   Children also get PR_SET_PDEATHSIG, so even a SIGKILLed supervisor leaves no child behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
import os
import signal
import socket
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field

from mooncaked.config import Config, InstanceConfig
from mooncaked.runtime.errors import StartupError
from mooncaked.runtime.lifecycle import EXIT_FATAL
from mooncaked.runtime.supervised import start_supervised, stop_task

logger = logging.getLogger(__name__)

_START_TIERS = (("store",), ("prefill", "decode"), ("conductor",))
_PR_SET_PDEATHSIG = 1
CRASH_LOOP_CRASHES = 3
CRASH_LOOP_WINDOW_S = 300.0


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
    status: str = ""  # the last sd_notify STATUS= text it sent
    crash_times: deque[float] = field(default_factory=lambda: deque(maxlen=CRASH_LOOP_CRASHES))

    def is_crash_looping(self, now: float) -> bool:
        return len(self.crash_times) == CRASH_LOOP_CRASHES and now - self.crash_times[0] <= CRASH_LOOP_WINDOW_S


class Supervisor:
    """Owns the child processes, their notify sockets and monitor tasks, and the fatal error if one happened."""

    name = "supervisor"

    def __init__(self, config: Config, *, config_path: str, overrides: list[str],
                 ready_timeout_s: float = 120.0, min_backoff_s: float = 1.0, max_backoff_s: float = 30.0,
                 stable_after_s: float = 60.0) -> None:
        self.config = config
        self.config_path = config_path
        self.overrides = list(overrides)
        self.ready_timeout_s = ready_timeout_s
        self.min_backoff_s = min_backoff_s
        self.max_backoff_s = max_backoff_s
        self.stable_after_s = stable_after_s
        self.children = [Child(i) for i in config.cluster.instances if is_local_host(i.host)]
        self._is_stopping = False
        self.fatal_error = ""
        self.stop_requested = asyncio.Event()  # set when a child hit a fatal error: the runner stops us
        self._has_failed = asyncio.Event()  # the same, for start(); the runner's signals set only stop_requested
        self._monitors: list[asyncio.Task[None]] = []
        self._tmpdir = tempfile.mkdtemp(prefix="mooncaked-supervisor-")

    async def start(self) -> None:
        if not self.children:
            raise RuntimeError("no instance in cluster.instances is configured for this host")
        for tier in _START_TIERS:
            tier_children = [c for c in self.children if c.instance.role in tier]
            for child in tier_children:
                await self._spawn(child)
                self._monitors.append(start_supervised(f"monitor-{child.instance.name}",
                                                       functools.partial(self._monitor, child), may_return=True))
            await self._wait_ready(tier_children)

    async def _wait_ready(self, children: list[Child]) -> None:
        """Until every child of the tier is ready; StartupError as soon as one fails fatally."""
        all_ready: asyncio.Future[object] = asyncio.ensure_future(asyncio.gather(*(c.ready.wait() for c in children)))
        failed: asyncio.Future[object] = asyncio.ensure_future(self._has_failed.wait())
        try:
            await asyncio.wait({all_ready, failed}, timeout=self.ready_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (all_ready, failed):
                task.cancel()
            await asyncio.gather(all_ready, failed, return_exceptions=True)
        if self.fatal_error:
            raise StartupError(self.fatal_error)
        late = [c.instance.name for c in children if not c.ready.is_set()]
        if late:
            raise RuntimeError(f"instances {late} did not become ready within {self.ready_timeout_s}s")

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
                lines = child.notify_sock.recv(4096).decode(errors="replace").splitlines()
                if "READY=1" in lines:
                    child.ready.set()
                child.status = next((line[len("STATUS="):] for line in lines if line.startswith("STATUS=")),
                                    child.status)

    async def _monitor(self, child: Child) -> None:
        backoff_s = self.min_backoff_s
        while True:
            assert child.process is not None
            code = await child.process.wait()
            if self._is_stopping:
                return
            if code == EXIT_FATAL:
                self._fail(child)
                return
            uptime_s = time.monotonic() - child.started_at
            if uptime_s >= self.stable_after_s:
                backoff_s = self.min_backoff_s
            self._log_crash(child, code, uptime_s, backoff_s)
            await asyncio.sleep(backoff_s)
            if self._is_stopping:
                return
            backoff_s = min(backoff_s * 2, self.max_backoff_s)
            child.num_restarts += 1
            await self._spawn(child)

    def _fail(self, child: Child) -> None:
        if child.notify_sock is not None:
            self._on_notify(child)  # its STATUS= may still wait in the socket
        cause = child.status or "exited with status 2, a configuration or load error (see its log above)"
        self.fatal_error = f"{child.instance.role} {child.instance.name} {cause}"
        logger.error("%s; stopping every instance: a restart cannot fix this", self.fatal_error)
        self._has_failed.set()
        self.stop_requested.set()

    def _log_crash(self, child: Child, code: int, uptime_s: float, backoff_s: float) -> None:
        now = time.monotonic()
        child.crash_times.append(now)
        how = describe_exit(code)
        if child.is_crash_looping(now):
            logger.error("%s is in a crash loop: %d crashes within %.0f s (the last: %s after %.1f s up); "
                         "restarting in %.1f s", child.instance.name, CRASH_LOOP_CRASHES,
                         now - child.crash_times[0], how, uptime_s, backoff_s)
        else:
            logger.warning("%s crashed (%s) after %.1f s up; restarting in %.1f s", child.instance.name, how,
                           uptime_s, backoff_s)

    async def stop(self) -> None:
        self._is_stopping = True
        deadline_s = 2 * self.config.runtime.drain_timeout_s + 10.0  # a store drains, then writes DRAM to SSD
        for tier in reversed(_START_TIERS):
            tier_children = [c for c in self.children if c.instance.role in tier]
            await asyncio.gather(*(self._terminate(c, deadline_s) for c in tier_children))
        for task in self._monitors:
            await stop_task(task)
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


def describe_exit(code: int) -> str:
    """A child's return code in words: "exit status 1", "killed by SIGKILL"."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"
