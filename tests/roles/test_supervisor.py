"""`--role all` as a real process tree: readiness via sd_notify, restart of a killed child, SIGTERM draining an
in-flight call and leaving no process behind."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

from mooncaked.config import load_config
from mooncaked.kv.keys import block_keys, model_namespace
from mooncaked.model.loader import load_model
from mooncaked.roles.base import PeerClients
from mooncaked.roles.worker.messages import DECODE, RESERVE, DecodeRequest, ReserveRequest, SamplingSpec
from mooncaked.rpc.protocol import INFO, InfoRequest
from tests.roles.cluster_fixtures import instance


def write_config(tmp_path: Path) -> Path:
    data = {
        "cluster": {"id": "supervised", "instances": [instance("s0", "store"), instance("d0", "decode")]},
        "model": {"source": "random:tiny", "name": "tiny"},
        "kv": {"block_size": 16},
        "runtime": {"drain_timeout_s": 20.0},
        "store": {"dram_bytes": 16 << 20, "shm_dir": str(tmp_path)},
        "worker": {"num_kv_pages": 128},
    }
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}/stat").exists() else "X"
    return state not in ("Z", "X")


async def wait_for(predicate, timeout_s: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.2)


async def test_supervisor_restart_drain_and_clean_exit(tmp_path: Path) -> None:
    path = write_config(tmp_path)
    config = load_config(path)
    notify_path = str(tmp_path / "notify.sock")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(notify_path)
    notify.setblocking(False)
    env = {**os.environ, "NOTIFY_SOCKET": notify_path}
    proc = subprocess.Popen([sys.executable, "-m", "mooncaked", "--role", "all", "--config", str(path)], env=env)
    clients = PeerClients(config, config.instance_named("d0"))
    try:
        loop = asyncio.get_running_loop()
        ready = await asyncio.wait_for(loop.sock_recv(notify, 100), 120)
        assert ready == b"READY=1"
        store = clients.for_instance(config.instance_named("s0"))
        first_pid = (await store.call(INFO, InfoRequest(), timeout_s=5)).pid
        os.kill(first_pid, signal.SIGKILL)

        async def restarted() -> bool:
            try:
                return (await store.call(INFO, InfoRequest(), timeout_s=1)).pid != first_pid
            except Exception:
                return False

        await wait_for(restarted, 60)

        decode = clients.for_instance(config.instance_named("d0"))
        tokens = list(range(3, 40))
        loaded = load_model("random:tiny")
        keys = block_keys(tokens, 16, model_namespace(loaded.model_id, config.model.dtype, 16, loaded.args.kv_geometry))
        spec = SamplingSpec(max_tokens=300, temperature=0.0, ignore_eos=True)
        reply = await decode.call(RESERVE, ReserveRequest("drain", keys, len(tokens), 300, 60_000,
                                                          is_inline_prefill=True), timeout_s=10)
        assert reply.is_accepted, reply.reason
        received = 0
        pids: list[int] = []
        stream = decode.stream(DECODE, DecodeRequest("drain", tokens, keys, spec), timeout_s=60)
        async for item in stream:
            received += len(item.tokens)
            if received >= 5 and not pids:
                pids = children_of(proc.pid)
                assert len(pids) == 2
                proc.send_signal(signal.SIGTERM)  # mid-stream: the call must be drained, not cut
            if item.finish_reason:
                break
        assert received == 300
        assert await loop.run_in_executor(None, proc.wait, 60) == 0
        assert not any(alive(p) for p in pids)
        messages = [notify.recv(100) for _ in range(1)]
        assert b"STOPPING=1" in messages
    finally:
        await clients.close()
        if proc.poll() is None:
            proc.kill()
        notify.close()
