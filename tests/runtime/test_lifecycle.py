"""run_role in a process of its own: once the role is ready its live objects are frozen out of the collector's
reach (no full collection walks them while serving or at exit); an in-process `serve` leaves the collector alone."""

from __future__ import annotations

import asyncio
import gc
import json
import subprocess
import sys
from pathlib import Path

from mooncaked.runtime.lifecycle import serve
from mooncaked.runtime.sdnotify import Notifier

_PROCESS = """
import asyncio, gc, json, weakref
from mooncaked.runtime.lifecycle import run_role
from mooncaked.runtime.sdnotify import Notifier

stop = asyncio.Event()
seen = {}

class Node:
    pass

class Role:
    name = "probe"
    async def start(self):
        node = Node()
        node.itself = node  # garbage made at start-up, in a cycle: collected before the freeze
        self.garbage = weakref.ref(node)
        seen["frozen_at_start"] = gc.get_freeze_count()
        asyncio.get_running_loop().call_soon(self.ready)
    def ready(self):
        seen["frozen_when_ready"] = gc.get_freeze_count()
        seen["is_garbage_collected"] = self.garbage() is None
        stop.set()
    async def stop(self):
        pass

code = run_role(Role, Notifier(None), None, stop)
print(json.dumps({**seen, "code": code}))
"""


def test_a_role_process_freezes_its_objects_once_ready() -> None:
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", _PROCESS], cwd=root, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["code"] == 0 and seen["frozen_at_start"] == 0
    assert seen["frozen_when_ready"] > 1000, "the imported modules' objects are frozen"
    assert seen["is_garbage_collected"], "start-up garbage is collected, not frozen"


async def test_serve_in_a_shared_process_does_not_freeze() -> None:
    class Role:
        name = "in-process"

        async def start(self) -> None:
            stop.set()

        async def stop(self) -> None:
            pass

    stop = asyncio.Event()
    before = gc.get_freeze_count()
    assert await serve(Role(), Notifier(None), None, stop) == 0
    assert gc.get_freeze_count() == before
