"""NUMA placement: memory bound to a node lands there; a node this process may not use is named."""

from __future__ import annotations

import ctypes
import mmap
import platform

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncaked.runtime.numa import NumaError, allowed_memory_nodes, memory_bound_to, page_node, parse_id_list
from mooncaked.store.shm_pool import ShmPool

needs_numa_syscalls = pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"),
                                         reason="memory-policy syscall numbers are known for x86_64 and aarch64")


@needs_numa_syscalls
def test_memory_touched_while_bound_lands_on_the_node() -> None:
    node = min(allowed_memory_nodes())
    with memory_bound_to(node):
        mapping = mmap.mmap(-1, 1 << 20)
        np.frombuffer(mapping, dtype=np.uint8)[:] = 1
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    assert page_node(address) == node
    assert page_node(address + (1 << 20) - 1) == node


@needs_numa_syscalls
def test_a_store_pool_is_bound_to_its_node(tmp_path: object) -> None:
    node = min(allowed_memory_nodes())
    pool = ShmPool.create(f"{tmp_path}/pool", 4 << 20, numa_node=node)
    try:
        start = ctypes.addressof(ctypes.c_char.from_buffer(pool.view))
        assert {page_node(start + offset) for offset in range(0, 4 << 20, 1 << 20)} == {node}
    finally:
        pool.close()


def test_a_node_out_of_reach_is_named(tmp_path: object) -> None:
    unusable = max(allowed_memory_nodes()) + 1
    with pytest.raises(NumaError, match=rf"NUMA node {unusable} is not usable by this process \(allowed: "):
        with memory_bound_to(unusable):
            pass
    with pytest.raises(NumaError, match=f"NUMA node {unusable}"):
        ShmPool.create(f"{tmp_path}/pool", 1 << 20, numa_node=unusable)
    assert not (__import__("pathlib").Path(f"{tmp_path}/pool")).exists()


@given(st.sets(st.integers(0, 300), max_size=20))
def test_id_lists_round_trip(ids: set[int]) -> None:
    text = ",".join(str(i) for i in sorted(ids))
    assert parse_id_list(text) == ids
    runs = ",".join(f"{i}-{i + 2}" for i in sorted(ids))
    assert parse_id_list(runs) == {j for i in ids for j in range(i, i + 3)}


@given(st.text(alphabet="0123456789-,x ", max_size=12))
def test_bad_id_lists_are_refused_with_the_part(text: str) -> None:
    try:
        parse_id_list(text)
    except ValueError as exc:
        assert "not a CPU/node list item" in str(exc)
