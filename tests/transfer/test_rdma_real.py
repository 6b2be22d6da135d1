"""Real RDMA through pyverbs: one NIC, two engines in this process, a WRITE and a READ checked byte for byte.

Skips, with the reason, where pyverbs cannot be imported or no RDMA device exists."""

from __future__ import annotations

import os

import numpy as np
import pytest

from mooncaked.transfer import TransferEngine, TransferOp, TransferRequest
from mooncaked.transfer.pyverbs_provider import PyverbsProvider
from mooncaked.transfer.verbs import RdmaUnavailable


def load_provider() -> PyverbsProvider:
    if not os.path.isdir("/sys/class/infiniband") or not os.listdir("/sys/class/infiniband"):
        pytest.skip("no RDMA device: /sys/class/infiniband is absent or empty")
    try:
        return PyverbsProvider.load()
    except RdmaUnavailable as exc:
        pytest.skip(f"RDMA unavailable: {exc}")


async def test_write_and_read_over_a_real_nic() -> None:
    provider = load_provider()
    a = TransferEngine(host="127.0.0.1", transports=("rdma",), verbs=provider)
    b = TransferEngine(host="127.0.0.2", transports=("rdma",), verbs=provider)
    await a.start()
    await b.start()
    try:
        assert a.rdma is not None, a.rdma_unavailable_reason
        src = np.random.default_rng(0).integers(0, 256, 4 << 20, dtype=np.uint8)
        dst, back = np.zeros_like(src), np.zeros_like(src)
        a.register("src", src)
        a.register("back", back)
        ref = b.register("dst", dst)
        await a.wait(a.submit([TransferRequest(TransferOp.WRITE, "src", 0, ref, 0, src.nbytes)]), timeout_s=30)
        await a.wait(a.submit([TransferRequest(TransferOp.READ, "back", 0, ref, 0, src.nbytes)]), timeout_s=30)
        assert np.array_equal(dst, src) and np.array_equal(back, src)
    finally:
        await a.stop()
        await b.stop()
