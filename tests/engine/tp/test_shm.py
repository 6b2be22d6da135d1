"""The shared-memory all-reduce and all-gather, with two ranks as threads of this process: sums agree bit for bit
across ranks through many operations of varying sizes (the two alternating slot sets), gathers put the ranks'
columns in rank order, and a peer that never arrives or is lost fails the wait by its deadline."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncaked.engine.tp import shm as tp_shm
from mooncaked.engine.tp.shm import SharedMemoryReducer

pytestmark = pytest.mark.skipif(not tp_shm.is_supported(), reason="needs x86-64 Linux (memfd, eventfd)")
SLOT_BYTES = 4096


def _pair(timeout_s: float = 10.0) -> tuple[SharedMemoryReducer, SharedMemoryReducer]:
    first = SharedMemoryReducer.create(2, SLOT_BYTES, timeout_s, None, lambda: False)
    second_fds = [os.dup(fd) for fd in first.fds]  # as a rank process receives them
    return first, SharedMemoryReducer(second_fds, 1, 2, SLOT_BYTES, timeout_s, None, lambda: False)


@settings(max_examples=20, deadline=None)
@given(sizes=st.lists(st.integers(min_value=1, max_value=SLOT_BYTES // 4), min_size=1, max_size=12))
def test_every_rank_gets_the_same_sum(sizes: list[int]) -> None:
    ranks = _pair()
    gen = torch.Generator().manual_seed(len(sizes))
    inputs = [[torch.randn(n, generator=gen) for n in sizes] for _ in ranks]
    outputs: list[list[torch.Tensor]] = [[], []]

    def run(rank: int) -> None:
        for tensor in inputs[rank]:  # an all-reduce, then an all-gather of [1, n]: both slot sets in turn
            mine = tensor.clone()
            ranks[rank].all_reduce(mine)
            outputs[rank].append(mine)
            outputs[rank].append(ranks[rank].all_gather(tensor.view(1, -1)))

    thread = threading.Thread(target=run, args=(1,))
    thread.start()
    run(0)
    thread.join(30)
    assert not thread.is_alive()
    for i, (x, y) in enumerate(zip(inputs[0], inputs[1])):
        assert torch.equal(outputs[0][2 * i], outputs[1][2 * i]) and torch.equal(outputs[0][2 * i], x + y)
        gathered = torch.cat([x, y]).view(1, -1)
        assert torch.equal(outputs[0][2 * i + 1], gathered) and torch.equal(outputs[1][2 * i + 1], gathered)
    for reducer in ranks:
        reducer.close()


def test_a_peer_that_never_comes_fails_by_the_deadline() -> None:
    first, second = _pair(timeout_s=0.5)
    begin = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1\] did not arrive within 0.5 s"):
        first.all_reduce(torch.ones(8))
    assert time.monotonic() - begin < 3.0
    second.close()
    first.close()


def test_a_lost_peer_fails_the_wait_at_once() -> None:
    first = SharedMemoryReducer.create(2, SLOT_BYTES, 30.0, None, lambda: True)
    begin = time.monotonic()
    with pytest.raises(RuntimeError, match="exited during an all-reduce"):
        first.all_reduce(torch.ones(8))
    assert time.monotonic() - begin < 3.0
    first.close()
