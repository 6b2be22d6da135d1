"""Test-session set-up.

1. Without a CUDA device Triton runs in its interpreter on CPU (TRITON_INTERPRET=1, set before any kernel is
   imported); with one it compiles for the device, the CPU-interpreter kernel tests skip and the tests marked
   `gpu` check the kernels on the device instead.
2. Tests marked `gpu` skip where no CUDA device is available.
3. Hypothesis draws the same examples on every run (`derandomize`), so `make test` passes or fails the same way
   each time; `HYPOTHESIS_PROFILE=explore make test` draws new ones to hunt for bugs (pin what it finds with
   `@example`).
4. `make_testnet(num_hosts, num_nics, rate_mbit)` lays out a test network (mooncaked/bench/testnet.py) that is
   torn down after the test, whether it passed or not; tests using it skip where namespaces cannot be made.
"""

import os
from collections.abc import Callable, Iterator

import pytest
import torch
from hypothesis import settings

from mooncaked.bench import testnet

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

settings.register_profile("repeatable", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_TESTNET_UNAVAILABLE: list[str] = []  # the probe's answer, once per session


@pytest.fixture
def make_testnet() -> Iterator[Callable[..., testnet.TestNet]]:
    """A factory of test networks, each torn down (processes, namespaces, links) after the test."""
    if not _TESTNET_UNAVAILABLE:
        _TESTNET_UNAVAILABLE.append(testnet.unavailable_reason())
    if _TESTNET_UNAVAILABLE[0]:
        pytest.skip(_TESTNET_UNAVAILABLE[0])
    made: list[testnet.TestNet] = []

    def make(num_hosts: int, num_nics: int, rate_mbit: float | None = None) -> testnet.TestNet:
        net = testnet.TestNet(num_hosts, num_nics, rate_mbit)
        made.append(net)
        return net.up()

    yield make
    for net in made:
        net.down()
