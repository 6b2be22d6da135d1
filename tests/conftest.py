"""Test-session set-up.

1. Without a CUDA device Triton runs in its interpreter on CPU (TRITON_INTERPRET=1, set before any kernel is
   imported); with one it compiles for the device, the CPU-interpreter kernel tests skip and the tests marked
   `gpu` check the kernels on the device instead.
2. Tests marked `gpu` skip where no CUDA device is available.
3. Hypothesis draws the same examples on every run (`derandomize`), so `make test` passes or fails the same way
   each time; `HYPOTHESIS_PROFILE=explore make test` draws new ones to hunt for bugs (pin what it finds with
   `@example`).
"""

import os

import pytest
import torch
from hypothesis import settings

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
