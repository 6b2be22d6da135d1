"""Every wait has a deadline (docs/design.md, "How we write code"), checked with `ast` over the package.

A wait is an `await` of a future or task (a bare name or attribute), of an event, condition or process
(`.wait()`), of a queue (`.get()`, `.join()`), of a stream read (`.read()`, `.readline()`, `.read_chunk()`, ...),
of `asyncio.wait` without a timeout, an `async for` over an aiohttp stream (`.content`), and any RPC call or stream
(`.call(METHOD, ...)`, `.stream(METHOD, ...)`) without its `timeout_s`. Each must sit inside
`async with asyncio.timeout(...)` / `asyncio.timeout_at(...)` in its own function, or be listed in ALLOWED with
what bounds it instead. Waits through `asyncio.wait_for`, `asyncio.wait(..., timeout=...)` and the project's own
APIs that take a deadline argument (`engine.wait(batch, timeout_s)`) are bounded by construction.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "mooncaked"
NO_ARGUMENT_WAITS = frozenset({"wait", "get", "join"})  # Event/Condition/process .wait(), Queue .get()/.join()
STREAM_READS = frozenset({"read", "readline", "readexactly", "readuntil", "readany", "read_chunk"})
TIMEOUT_CONTEXTS = frozenset({"asyncio.timeout", "asyncio.timeout_at"})

# (file, function) -> what bounds its waits instead of a timeout context.
ALLOWED = {
    # Cancellation bounds them: a supervised loop idle until work arrives, ended by its owner's stop().
    ("roles/worker/decode/loop.py", "DecodeLoop._run"): "idle until a sequence joins; stop() cancels it",
    ("roles/worker/prefill/role.py", "PrefillRole._batch_loop"): "idle until a prompt is queued; stop() cancels it",
    ("roles/worker/group/stage.py", "StageService._chunk_loop"): "idle until a chunk arrives; stop() cancels it",
    ("runtime/supervised.py", "stop_task"): "awaits a task it has just cancelled",
    ("runtime/lifecycle.py", "_wait_stop_or_failure"): "a process runs until a signal or a failure, by design",
    ("roles/supervisor.py", "Supervisor._monitor"): "a child runs until it exits, by design; stop() cancels this",
    ("roles/supervisor.py", "Supervisor._terminate"): "the reap after SIGKILL, once wait_for has timed out",
    # The compute thread bounds them: it leaves a step or batch at its next layer boundary.
    ("roles/worker/decode/loop.py", "DecodeLoop._compute"): "the step the thread runs, after a cancellation",
    ("roles/worker/decode/loop.py", "DecodeLoop.remove"): "the decode step under way",
    ("roles/worker/prefill/batch.py", "BatchRunner._compute"): "the batch the thread runs, after a cancellation",
    ("roles/worker/prefill/role.py", "PrefillRole._prefill"): "its RPC deadline (job.future); the thread (idle)",
    ("roles/worker/group/head.py", "PipelineRun._compute"): "the forward the thread runs, after a cancellation",
    ("roles/worker/group/stage.py", "StageService._close"): "the chunk the thread computes for the job",
    # The call's own deadline bounds them (the RPC deadline wheel, a handler's deadline, the caller's timeout).
    ("rpc/client_conn.py", "ClientConnection.call"): "the DeadlineWheel fails the waiter at timeout_s",
    ("rpc/client_conn.py", "ClientConnection.next_item"): "the DeadlineWheel fails the stream at timeout_s",
    ("rpc/client_conn.py", "ClientConnection._next_handshake_frame"): "RpcClient's connect_timeout_s",
    ("rpc/frames.py", "FramedProtocol.drain"): "the server cancels a stream's handler at its deadline",
    ("api/generation.py", "serve_generation"): "the work's every step has request_timeout_s; the watch polls",
    ("api/generation.py", "merge_choices"): "each feeder's stream ends by its own deadlines (first-token, token)",
    ("roles/worker/decode/reservations.py", "ReservationBook.drop"): "its store calls' deadlines (no delay here)",
    ("cluster/etcd_membership.py", "EtcdMembership._session"): "its watch and keep-alive calls' deadlines",
    ("cluster/etcd_client.py", "EtcdClient.watch_prefix"): "aiohttp's sock_read (watch_renew_s) per read",
}


def _name(node: ast.expr) -> str:
    return ast.unparse(node)


def _is_rpc_without_deadline(call: ast.Call) -> bool:
    """`.call(METHOD, request)` / `.stream(METHOD, request)` with no `timeout_s` (an upper-case method constant)."""
    if not isinstance(call.func, ast.Attribute) or call.func.attr not in ("call", "stream") or not call.args:
        return False
    method = _name(call.args[0]).rpartition(".")[2]
    has_deadline = any(k.arg == "timeout_s" for k in call.keywords) or len(call.args) >= 3
    return method.isupper() and not has_deadline


def _unbounded_kind(awaited: ast.expr) -> str | None:
    if isinstance(awaited, (ast.Name, ast.Attribute)):
        return "future"
    if not isinstance(awaited, ast.Call) or not isinstance(awaited.func, ast.Attribute):
        return None
    attribute, base = awaited.func.attr, _name(awaited.func.value)
    if base == "asyncio":
        has_timeout = any(k.arg == "timeout" for k in awaited.keywords) or len(awaited.args) >= 2
        return "asyncio.wait" if attribute == "wait" and not has_timeout else None
    if attribute in NO_ARGUMENT_WAITS and not awaited.args and not awaited.keywords:
        return f".{attribute}()"
    return "stream read" if attribute in STREAM_READS else None  # RPC calls: visit_Call, awaited or not


class _Finder(ast.NodeVisitor):
    """Collects (function, kind, source) of every wait outside a timeout context."""

    def __init__(self) -> None:
        self.functions: list[str] = []
        self.num_timeouts = 0
        self.found: list[tuple[str, str, str]] = []

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.functions.append(node.name)
        outer, self.num_timeouts = self.num_timeouts, 0
        self.generic_visit(node)
        self.num_timeouts = outer
        self.functions.pop()

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    def visit_AsyncWith(self, node: ast.AsyncWith) -> None:
        is_timeout = any(isinstance(item.context_expr, ast.Call) and _name(item.context_expr.func) in TIMEOUT_CONTEXTS
                         for item in node.items)
        for item in node.items:
            self.visit(item)
        self.num_timeouts += is_timeout
        for statement in node.body:
            self.visit(statement)
        self.num_timeouts -= is_timeout

    def visit_Await(self, node: ast.Await) -> None:
        self._check(_unbounded_kind(node.value), node)
        self.generic_visit(node)

    def visit_AsyncFor(self, node: ast.AsyncFor) -> None:
        is_stream = isinstance(node.iter, ast.Attribute) and node.iter.attr == "content"
        self._check("stream read" if is_stream else None, node.iter)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if _is_rpc_without_deadline(node):
            self._check("rpc", node)
        self.generic_visit(node)

    def _check(self, kind: str | None, node: ast.AST) -> None:
        if kind is not None and not self.num_timeouts:
            self.found.append((".".join(self.functions), kind, ast.unparse(node)[:100]))


def unbounded_waits() -> Iterator[tuple[str, str, str, str]]:
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        relative = path.relative_to(PACKAGE_DIR).as_posix()
        if relative.startswith("bench/"):  # benchmarks: one process per run, not the serving system
            continue
        finder = _Finder()
        finder.visit(ast.parse(path.read_text(), str(path)))
        for function, kind, source in finder.found:
            yield relative, function, kind, source


def test_every_wait_has_a_deadline_or_says_what_bounds_it() -> None:
    waits = list(unbounded_waits())
    unlisted = [wait for wait in waits if (wait[0], wait[1]) not in ALLOWED]
    assert not unlisted, "waits without a deadline (wrap them in asyncio.timeout, or list them in ALLOWED with " \
        "what bounds them):\n" + "\n".join(" | ".join(wait) for wait in unlisted)
    stale = sorted(set(ALLOWED) - {(wait[0], wait[1]) for wait in waits})
    assert not stale, f"ALLOWED entries with no wait left: {stale}"


def test_the_check_sees_each_kind_of_wait() -> None:
    source = '''
async def waits(event, queue, stream, client, response, future):
    await event.wait()
    await queue.get()
    await stream.readline()
    await client.call(LOAD, request)
    await future
    await asyncio.wait(futures)
    async for line in response.content:
        pass
    async with asyncio.timeout(1.0):
        await event.wait()
    await asyncio.wait_for(event.wait(), 1.0)
    await client.call(LOAD, request, timeout_s=1.0)
    await engine.wait(batch, 1.0)
'''
    finder = _Finder()
    finder.visit(ast.parse(source))
    assert [kind for _, kind, _ in finder.found] == [".wait()", ".get()", "stream read", "rpc", "future",
                                                    "asyncio.wait", "stream read"]
