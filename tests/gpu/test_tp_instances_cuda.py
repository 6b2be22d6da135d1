"""Prefill and decode instances with two ranks on two GPUs (NCCL; each rank's pages opened in rank 0 through
CUDA IPC, moved through staging by a copy stream per device): the hand-offs of
tests/roles/worker/test_tensor_parallel_instances.py with the tiny model in fp32 on CUDA. Needs two GPUs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mooncaked.config import Config
from mooncaked.model.loader import load_model
from tests.roles.cluster_fixtures import cluster_config, instance
from tests.roles.engine_reference import greedy_tokens
from tests.roles.worker.test_tensor_parallel_instances import NUM_NEW, TP2, _two_requests, prompt

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism on CUDA needs two GPUs")]


def _config(tmp_path: Path, prefill: dict[str, object], decode: dict[str, object]) -> Config:
    return cluster_config(tmp_path, [instance("s0", "store"), instance("p0", "prefill", **prefill),
                                     instance("d0", "decode", **decode)],
                          model={"device": "cuda", "dtype": "float32", "cuda_graphs": False})


async def test_prefill_on_two_gpus_then_decode_on_one_equals_one_instance(tmp_path: Path) -> None:
    tokens = prompt(1, 53)
    expected = greedy_tokens(load_model("random:tiny"), tokens, NUM_NEW)
    config = _config(tmp_path, TP2, {})
    assert await _two_requests(config, tokens, "p0", "p0") == [(expected, 0), (expected, 48)]


async def test_prefill_on_one_gpu_then_decode_and_inline_prefill_on_two(tmp_path: Path) -> None:
    tokens = prompt(2, 40)
    expected = greedy_tokens(load_model("random:tiny"), tokens, NUM_NEW)
    config = _config(tmp_path, {}, TP2)
    assert await _two_requests(config, tokens, "p0", "p0", second_inline=True) == [(expected, 0), (expected, 32)]
