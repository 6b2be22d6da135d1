"""The KV page count from a worker's memory budget: override, bytes, GPU fraction, defaults, too small."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mooncaked.engine.kv_budget import (DEFAULT_CPU_KV_BYTES, MIB, DeviceMemory, KVBudget, KVBudgetTooSmall,
                                        page_nbytes, size_kv)
from mooncaked.engine.kv_pages import KVPages
from mooncaked.model.presets import random_preset

ARGS = random_preset("smollm2-135m")  # SmolLM2's shapes: 30 layers, 3 KV heads of 64
PER_PAGE = 30 * 2 * 64 * 3 * 64 * 4  # 64 tokens of every layer's K and V, fp32


def test_page_bytes_match_the_allocated_pages() -> None:
    assert page_nbytes(ARGS, 64, torch.float32) == PER_PAGE
    pages = KVPages.for_model(ARGS, num_pages=3, block_size=64, dtype=torch.float32, device="cpu")
    assert sum(t.numel() * t.element_size() for t in pages.k_pages + pages.v_pages) == 3 * PER_PAGE
    assert pages.block_nbytes == PER_PAGE


def test_the_budget_chooses_the_page_count() -> None:
    sizing = size_kv(KVBudget(kv_memory_bytes=512 * MIB), args=ARGS, block_size=64, dtype=torch.float32,
                     device_type="cpu", max_model_len=2048)
    assert sizing.num_pages == 512 * MIB // PER_PAGE == 182 and sizing.num_tokens == 182 * 64
    assert sizing.describe() == "KV cache: 182 pages = 11648 tokens, 0.50 GiB (worker.kv_memory_bytes = 512 MiB)"
    default = size_kv(KVBudget(), args=ARGS, block_size=64, dtype=torch.float32, device_type="cpu",
                      max_model_len=2048)
    assert default.num_pages == DEFAULT_CPU_KV_BYTES // PER_PAGE and "default KV budget" in default.origin
    # an explicit page count overrides any budget, and is not checked against max_model_len (the user chose it)
    assert size_kv(KVBudget(num_kv_pages=3, kv_memory_bytes=1), args=ARGS, block_size=64, dtype=torch.float32,
                   device_type="cpu", max_model_len=2048).num_pages == 3


def test_a_budget_below_one_request_is_refused_with_what_it_needs() -> None:
    needed = 32 * PER_PAGE  # 2048 tokens in pages of 64
    with pytest.raises(KVBudgetTooSmall) as error:
        size_kv(KVBudget(kv_memory_bytes=needed - 1), args=ARGS, block_size=64, dtype=torch.float32,
                device_type="cpu", max_model_len=2048)
    assert str(error.value) == (
        "worker.kv_memory_bytes = 90.00 MiB holds 31 KV pages (1984 tokens) but one request of model.max_model_len "
        f"= 2048 tokens needs 32 pages of 2.81 MiB = 90 MiB; set worker.kv_memory_bytes to at least {needed} "
        "(90 MiB) or lower model.max_model_len")
    assert size_kv(KVBudget(kv_memory_bytes=needed), args=ARGS, block_size=64, dtype=torch.float32,
                   device_type="cpu", max_model_len=2048).num_pages == 32


def test_memory_fraction_sizes_from_the_gpu_memory_free_at_start() -> None:
    free = 40 << 30
    memory = DeviceMemory(free_before_load=free, free_after_load=free - (2 << 30), workspace_bytes=1 << 30)
    sizing = size_kv(KVBudget(memory_fraction=0.5), args=ARGS, block_size=64, dtype=torch.float32,
                     device_type="cuda", max_model_len=2048, device_memory=memory)
    assert sizing.num_pages == ((20 << 30) - (2 << 30) - (1 << 30)) // PER_PAGE
    assert sizing.origin.startswith("worker.memory_fraction = 0.5 of 40.00 GiB free, less 2.00 GiB of weights")
    default = size_kv(KVBudget(), args=ARGS, block_size=64, dtype=torch.float32, device_type="cuda",
                      max_model_len=2048, device_memory=memory)
    assert default.num_pages == (int(0.9 * free) - (3 << 30)) // PER_PAGE
    tight = DeviceMemory(free_before_load=4 << 30, free_after_load=1 << 30, workspace_bytes=0)
    with pytest.raises(KVBudgetTooSmall, match="raise worker.memory_fraction, free GPU memory"):
        size_kv(KVBudget(memory_fraction=0.5), args=ARGS, block_size=64, dtype=torch.float32, device_type="cuda",
                max_model_len=2048, device_memory=tight)


def test_memory_fraction_on_cpu_is_refused() -> None:
    with pytest.raises(ValueError, match="worker.memory_fraction sizes KV from free GPU memory, but model.device is "
                                         "cpu; set worker.kv_memory_bytes instead"):
        size_kv(KVBudget(memory_fraction=0.5), args=ARGS, block_size=64, dtype=torch.float32, device_type="cpu",
                max_model_len=2048)


@given(st.integers(1, 1 << 34), st.integers(1, 256), st.integers(16, 1 << 15),
       st.sampled_from([torch.float32, torch.bfloat16]))
def test_any_budget_fits_in_itself_or_is_refused(budget: int, block_size: int, max_model_len: int,
                                                 dtype: torch.dtype) -> None:
    per_page = page_nbytes(ARGS, block_size, dtype)
    try:
        sizing = size_kv(KVBudget(kv_memory_bytes=budget), args=ARGS, block_size=block_size, dtype=dtype,
                         device_type="cpu", max_model_len=max_model_len)
    except KVBudgetTooSmall as error:
        assert budget < -(-max_model_len // block_size) * per_page and "at least" in str(error)
        return
    assert sizing.nbytes <= budget < sizing.nbytes + per_page  # as many pages as fit, no more
    assert sizing.num_tokens >= max_model_len
