"""Layer-wise loading and storing on a CUDA worker (pinned staging, copy stream): the order test of
tests/roles/worker/test_layerwise_overlap.py with the model in fp16 on the device."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.roles.worker.test_layerwise_overlap import check_prefill_overlap, make_config

pytestmark = pytest.mark.gpu


async def test_prefill_loads_and_stores_overlap_compute_on_cuda(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    await check_prefill_overlap(make_config(tmp_path, device="cuda", dtype="float16"), monkeypatch)
