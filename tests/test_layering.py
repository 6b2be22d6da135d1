"""The package's import graph, read with `ast`: no circle, and every import follows docs/design.md's layering.

Every import counts, wherever it is written (module level, inside a function, under TYPE_CHECKING): a circle
broken by a deferred import is still a circle.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "mooncaked"

# Each part of the system (a folder of the package) and its layer: a module imports only from its own part and
# from parts of a lower layer (docs/design.md section 4). Parts on one layer are independent of each other.
LAYERS = {
    "runtime": 0, "kv": 0, "sched": 0, "kernels": 0, "api": 0,
    "rpc": 1, "transfer": 1, "model": 1, "sim": 1,
    "store": 2,
    "engine": 3,
    "config": 4,
    "cluster": 5,
    "roles": 6,
    "bench": 7,
    "cli": 8, "__main__": 9,
}
TOP_LEVEL_FILES = ("__init__.py", "__main__.py", "cli.py")
# Parts whose every module is pure policy: nothing heavier than the standard library, so the simulator runs it.
PURE = ("kv", "sched", "sim")
HEAVY_OR_IO = ("asyncio", "torch", "numpy", "triton", "mooncaked.rpc", "mooncaked.roles")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE_DIR.rglob("*.py"))}


def imported_names(path: Path, name: str) -> Iterator[str]:
    """Every absolute module name `path` imports; `from a import b` yields `a.b` (b may be a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def import_graph() -> dict[str, set[str]]:
    """Edges between the package's own modules (an import of `a.b.c` is an edge to the deepest module named)."""
    modules = package_modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for target in imported_names(path, name):
            if target in modules and target != name and not name.startswith(target + "."):
                graph[name].add(target)  # a submodule's implicit import of its own package is no edge
    return graph


def find_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        circles.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return circles


def part_of(name: str) -> str:
    """The part a module belongs to: its folder under mooncaked/ (or the top-level module's own name)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def violations(name: str, path: Path, modules: frozenset[str]) -> Iterator[str]:
    imports = set(imported_names(path, name))
    top = part_of(name)

    def reaches(prefix: str) -> bool:
        return any(i == prefix or i.startswith(prefix + ".") for i in imports)

    for target in sorted(i for i in imports if i in modules and i != "mooncaked"):
        other = part_of(target)
        if other != top and other in LAYERS and top in LAYERS and LAYERS[other] >= LAYERS[top]:
            yield (f"{name} imports {target}: mooncaked/{top}/ (layer {LAYERS[top]}) may not import "
                   f"mooncaked/{other}/ (layer {LAYERS[other]}), which is not below it")
    if top != "rpc":
        for target in sorted(i for i in imports if i.startswith("mooncaked.rpc.") and i in modules):
            yield f"{name} imports {target}: outside mooncaked/rpc/ import only what mooncaked.rpc exports"
    if top in PURE:
        for banned in HEAVY_OR_IO:
            if reaches(banned):
                yield f"{name} imports {banned}: policy is pure (no I/O, asyncio, torch or RPC)"
    if top == "sched":
        for target in sorted(imports):
            root = target.split(".")[0]
            if root != "mooncaked" and root not in sys.stdlib_module_names:
                yield f"{name} imports {target}: sched/ uses the standard library only"
            elif root == "mooncaked" and not target.startswith("mooncaked.sched"):
                yield f"{name} imports {target}: sched/ depends on nothing else in the package"


def test_the_package_has_no_import_circle() -> None:
    circles = find_circles(import_graph())
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


def test_every_import_follows_the_layering() -> None:
    modules = package_modules()
    found = [v for name, path in modules.items() for v in violations(name, path, frozenset(modules))]
    assert not found, "\n".join(found)


def test_only_the_entry_points_lie_at_the_top_level() -> None:
    loose = sorted(path.name for path in PACKAGE_DIR.glob("*.py") if path.name not in TOP_LEVEL_FILES)
    assert not loose, f"modules outside a part's folder: {loose}"


def test_every_part_has_a_layer() -> None:
    parts = {path.name for path in PACKAGE_DIR.iterdir() if (path / "__init__.py").exists()}
    assert parts <= set(LAYERS), f"folders without a layer in LAYERS: {sorted(parts - set(LAYERS))}"


def test_the_circle_finder_finds_circles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    assert find_circles(graph) == [["a", "b", "c"]]


@pytest.mark.parametrize(("name", "source", "expected"), [
    ("mooncaked.sched.x", "import asyncio", "policy is pure"),
    ("mooncaked.sched.x", "import yaml", "standard library only"),
    ("mooncaked.sched.x", "from mooncaked.kv import keys", "nothing else in the package"),
    ("mooncaked.kv.eviction", "from mooncaked.rpc import Method", "policy is pure"),
    ("mooncaked.kv.x", "import torch", "policy is pure"),
    ("mooncaked.sim.x", "import asyncio", "policy is pure"),
    ("mooncaked.engine.x", "from mooncaked.roles.worker import worker", "not below it"),
    ("mooncaked.store.client", "from mooncaked.rpc.frames import HEADER", "only what mooncaked.rpc exports"),
    ("mooncaked.model.x", "def f():\n    import mooncaked.roles.base", "not below it"),
    ("mooncaked.config.memory_plan", "from mooncaked.roles.worker import worker", "not below it"),
    ("mooncaked.runtime.x", "from mooncaked.config import Config", "not below it"),
    ("mooncaked.store.x", "from mooncaked.engine import runner", "not below it"),
    ("mooncaked.kv.x", "from mooncaked.sched import types", "not below it"),
    ("mooncaked.transfer.x", "import mooncaked.rpc", "not below it"),
])
def test_the_layering_check_catches(tmp_path: Path, name: str, source: str, expected: str) -> None:
    path = tmp_path / "x.py"
    path.write_text(source)
    assert any(expected in v for v in violations(name, path, frozenset(package_modules())))
