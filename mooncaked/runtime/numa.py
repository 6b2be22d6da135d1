"""NUMA memory placement through the kernel's memory-policy syscalls (no libnuma needed).

1. `allowed_memory_nodes()` reads the nodes this process may allocate on (its cpuset, /proc/self/status).
2. `memory_bound_to(node)` binds the calling thread's new allocations to `node` for the duration of a `with`
   block (set_mempolicy MPOL_BIND), then restores the default policy. Memory first touched (or, for a tmpfs
   file, fallocated) inside the block lands on that node: the store's pool and the workers' staging buffers.
3. `page_node(address)` tells on which node the page holding `address` lives (get_mempolicy), for checks.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
from collections.abc import Iterator

# (mbind, set_mempolicy, get_mempolicy) syscall numbers by machine
_SYSCALLS = {"x86_64": (237, 238, 239), "aarch64": (235, 237, 236)}
_MPOL_DEFAULT, _MPOL_BIND = 0, 2
_MPOL_F_NODE, _MPOL_F_ADDR = 1, 2
_MAX_NODES = 1024
_WORD_BITS = 64


class NumaError(OSError):
    """The kernel refused a placement; the message names the node and the allowed ones."""


def allowed_memory_nodes() -> set[int]:
    """Nodes this process may allocate memory on ({0} where the kernel does not say)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Mems_allowed_list:"):
                    return parse_id_list(line.split(":", 1)[1])
    except OSError:
        pass
    return {0}


def parse_id_list(text: str) -> set[int]:
    """Linux's list format, "0-2,5" -> {0, 1, 2, 5}; ValueError naming the bad part."""
    ids: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        low, sep, high = part.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ValueError(f"not a CPU/node list item: {part!r}")
        ids.update(range(int(low), int(high if sep else low) + 1))
    return ids


def _syscall(index: int, *args: object) -> None:
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        raise NumaError(f"NUMA placement is not supported on {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(numbers[index], *args) != 0:
        errno = ctypes.get_errno()
        raise NumaError(errno, os.strerror(errno))


def _node_mask(node: int) -> ctypes.Array[ctypes.c_ulong]:
    if not 0 <= node < _MAX_NODES:
        raise NumaError(f"NUMA node {node} is out of range [0, {_MAX_NODES})")
    mask = (ctypes.c_ulong * (_MAX_NODES // _WORD_BITS))()
    mask[node // _WORD_BITS] = 1 << (node % _WORD_BITS)
    return mask


@contextlib.contextmanager
def memory_bound_to(node: int) -> Iterator[None]:
    """New allocations of the calling thread come from `node` inside the block (NumaError if they cannot)."""
    allowed = allowed_memory_nodes()
    if node not in allowed:
        raise NumaError(f"NUMA node {node} is not usable by this process (allowed: "
                        f"{','.join(map(str, sorted(allowed)))})")
    mask = _node_mask(node)
    try:
        _syscall(1, ctypes.c_int(_MPOL_BIND), mask, ctypes.c_ulong(_MAX_NODES + 1))
    except NumaError as exc:
        raise NumaError(f"cannot bind memory to NUMA node {node}: {exc.strerror or exc}") from None
    try:
        yield
    finally:
        _syscall(1, ctypes.c_int(_MPOL_DEFAULT), None, ctypes.c_ulong(0))


def page_node(address: int) -> int:
    """The NUMA node of the (already touched) page holding `address`."""
    node = ctypes.c_int(-1)
    _syscall(2, ctypes.byref(node), None, ctypes.c_ulong(0), ctypes.c_void_p(address),
             ctypes.c_ulong(_MPOL_F_NODE | _MPOL_F_ADDR))
    return node.value
