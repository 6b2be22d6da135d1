"""Every long-lived background loop is supervised: read with `ast`, the package starts tasks with
`asyncio.create_task`, `ensure_future` or `loop.create_task` only where the task is short-lived and owned by the
code that awaits it (the allow-list below, with what ends each); a long-lived loop goes through
`mooncaked.runtime.supervised.start_supervised`, which logs its failure and restarts it or fails its instance."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "mooncaked"
TASK_STARTERS = frozenset({"create_task", "ensure_future"})

# file -> number of task starts in it, each short-lived: what ends it.
SHORT_LIVED = {
    "runtime/supervised.py": 1,  # the supervised tasks themselves
    "runtime/lifecycle.py": 2,  # waits on the stop and failure events, cancelled when either is set
    "rpc/client.py": 1,  # one connection slot's reconnect, ends once connected or when the client closes
    "rpc/server_conn.py": 1,  # one call's handler, ends with the call (its deadline)
    "api/generation.py": 3,  # one request's work, its client-gone watch and a parallel sampling's stream feeders,
    # end with the request
    "roles/worker/group/head.py": 2,  # one prompt's stage followers and its forward, end with the prompt
    "roles/worker/prefill/batch.py": 1,  # one batch's forward on the compute thread, awaited by the batch loop
    "roles/worker/decode/loop.py": 1,  # one step on the compute thread, awaited by the decode loop
    "roles/worker/decode/reservations.py": 1,  # a deferred store abort, ends after worker.abort_grace_s
    "roles/worker/kv/layer_loader.py": 2,  # one request's layer loads, end with its KV load deadline
    "roles/supervisor.py": 2,  # start-up's waits for ready and for a fatal failure, within ready_timeout_s
    "roles/conductor/batch/queue.py": 1,  # one batch line's run, ends with the line (request_timeout_s)
    "roles/conductor/batch/batches.py": 1,  # one batch's run, ends with the batch (its completion window)
    "cluster/etcd_membership.py": 2,  # per session, its watch and keepalive (the session is supervised)
    "transfer/engine.py": 1,  # waits on a batch's transfers, within the caller's deadline
}


def task_starts() -> Counter[str]:
    found: Counter[str] = Counter()
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        relative = path.relative_to(PACKAGE_DIR).as_posix()
        if relative.startswith("bench/"):  # benchmarks: one process per run, not the serving system
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in TASK_STARTERS:
                found[relative] += 1
    return found


def test_only_short_lived_tasks_are_started_outside_a_supervisor() -> None:
    assert dict(task_starts()) == SHORT_LIVED, (
        "a task start was added or removed: a long-lived loop must use runtime.supervised.start_supervised; a "
        "short-lived task goes into SHORT_LIVED with what ends it")
