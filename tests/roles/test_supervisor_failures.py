"""Fail fast on what a restart cannot fix, restart only crashes: `--role all` with a model it cannot load exits 2
with the loader's message and leaves nothing behind; a crashing child is restarted with backoff and a crash loop
is logged by the supervisor and shown on the conductor's /health."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from mooncaked.config import load_config
from mooncaked.roles import make_role
from mooncaked.roles.conductor.view.outages import CRASH_LOOP_OUTAGES
from mooncaked.roles.supervisor import CRASH_LOOP_CRASHES, Supervisor, describe_exit
from mooncaked.runtime.lifecycle import EXIT_FATAL
from tests.roles.cluster_fixtures import cluster_config, instance


def write_config(tmp_path: Path, model_source: str) -> Path:
    data = {
        "cluster": {"id": "failfast", "instances": [instance("s0", "store"), instance("d0", "decode")]},
        "model": {"source": model_source, "name": "tiny"},
        "kv": {"block_size": 16},
        "runtime": {"drain_timeout_s": 2.0},
        "store": {"dram_bytes": 8 << 20, "shm_dir": str(tmp_path / "shm")},
        "worker": {"num_kv_pages": 64},
    }
    (tmp_path / "shm").mkdir()
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_model_that_cannot_load_stops_role_all_with_status_2(tmp_path: Path) -> None:
    model_dir = tmp_path / "gpt2"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}')
    path = write_config(tmp_path, str(model_dir))
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "mooncaked", "--role", "all", "--config", str(path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == EXIT_FATAL, result.stderr
    assert time.monotonic() - started < 60, "no waiting for a ready that cannot come"
    errors = [line for line in result.stderr.splitlines()
              if "model_type 'gpt2'" in line and "is not supported" in line]
    assert any("decode d0 cannot start" in line and "restart cannot fix" in line for line in errors), result.stderr
    assert "restarting in" not in result.stderr, "a load error is never restarted"
    assert not os.listdir(tmp_path / "shm"), "the store that had started was stopped and released its pool"


def test_a_single_role_with_a_bad_secret_file_exits_2(tmp_path: Path) -> None:
    path = write_config(tmp_path, "random:tiny")
    result = subprocess.run([sys.executable, "-m", "mooncaked", "--role", "store", "--config", str(path),
                             "--set", f"cluster.secret_file={tmp_path / 'missing'}"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == EXIT_FATAL
    assert "cluster.secret_file: cannot read" in result.stderr and "restarting will not help" in result.stderr


def test_describe_exit() -> None:
    assert describe_exit(1) == "exit status 1" and describe_exit(-9) == "killed by SIGKILL"


async def test_a_crashing_child_is_restarted_with_backoff_and_a_crash_loop_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    path = tmp_path / "store.yaml"
    path.write_text(yaml.safe_dump({
        "cluster": {"id": "crashloop", "instances": [instance("s0", "store")]},
        "store": {"dram_bytes": 4 << 20, "shm_dir": str(tmp_path)},
        "runtime": {"drain_timeout_s": 1.0},
    }))
    supervisor = Supervisor(load_config(path), config_path=str(path), overrides=[], min_backoff_s=0.1,
                            max_backoff_s=0.4)
    caplog.set_level(logging.WARNING, logger="mooncaked.roles.supervisor")
    await supervisor.start()
    try:
        child = supervisor.children[0]
        for _ in range(CRASH_LOOP_CRASHES):
            assert child.process is not None
            pid = child.process.pid
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while not (child.process.pid != pid and child.ready.is_set()):
                assert time.monotonic() < deadline, "the crashed child was not restarted"
                await asyncio.sleep(0.05)
        assert child.num_restarts == CRASH_LOOP_CRASHES
        messages = [record.getMessage() for record in caplog.records]
        assert sum("crashed (killed by SIGKILL)" in m for m in messages) == CRASH_LOOP_CRASHES - 1
        assert any("s0 is in a crash loop" in m for m in messages), messages
        assert not supervisor.fatal_error and not supervisor.stop_requested.is_set()
    finally:
        await supervisor.stop()


async def test_the_conductor_health_names_an_instance_that_keeps_going_down(tmp_path: Path) -> None:
    config = cluster_config(tmp_path, [instance("c0", "conductor"), instance("s0", "store")],
                            conductor={"load_poll_interval_s": 0.05})
    conductor = make_role(config, config.instance_named("c0"))
    await conductor.start()
    store = None
    try:
        follower = conductor.view.followers["s0"]  # type: ignore[attr-defined]
        for _ in range(CRASH_LOOP_OUTAGES):
            store = make_role(config, config.instance_named("s0"))
            await store.start()
            await wait_until(lambda: follower.is_up)
            await store.stop()
            store = None
            await wait_until(lambda: not follower.is_up)
        port = conductor.bound_port  # type: ignore[attr-defined]
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/health") as response:
                health = await response.json()
        assert health["crash_looping"] == ["s0"]
        assert health["instances"]["s0"] == {"role": "store", "is_up": False, "recent_outages": CRASH_LOOP_OUTAGES,
                                             "last_error": follower.last_error}
    finally:
        if store is not None:
            await store.stop()
        await conductor.stop()


async def wait_until(predicate, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_a_monitor_that_fails_to_respawn_is_restarted_and_respawns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    path = tmp_path / "store.yaml"
    path.write_text(yaml.safe_dump({
        "cluster": {"id": "monitor", "instances": [instance("s0", "store")]},
        "store": {"dram_bytes": 4 << 20, "shm_dir": str(tmp_path)},
        "runtime": {"drain_timeout_s": 1.0},
    }))
    supervisor = Supervisor(load_config(path), config_path=str(path), overrides=[], min_backoff_s=0.1,
                            max_backoff_s=0.4)
    spawn = supervisor._spawn
    calls: list[str] = []

    async def spawn_failing_once_after_start(child: Any) -> None:
        calls.append(child.instance.name)
        if len(calls) == 2:
            raise OSError(24, "Too many open files (injected)")
        await spawn(child)

    supervisor._spawn = spawn_failing_once_after_start  # type: ignore[method-assign]
    await supervisor.start()
    try:
        child = supervisor.children[0]
        assert child.process is not None
        pid = child.process.pid
        os.kill(pid, signal.SIGKILL)
        await wait_until(lambda: child.process is not None and child.process.pid != pid and child.ready.is_set(),
                         timeout_s=60)
        assert len(calls) == 3
        assert "background loop monitor-s0 failed: OSError: [Errno 24] Too many open files (injected); " \
               "restarting it" in caplog.text
    finally:
        await supervisor.stop()
