"""Triton store_kv and block gather/scatter (interpreter on CPU) equal the reference exactly."""

import pytest
import torch

from mooncaked import kernels
from tests.triton_mode import needs_triton_interpreter

pytestmark = needs_triton_interpreter

NUM_PAGES, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 9, 16, 3, 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_equals_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    # k and v are strided views into one fused qkv tensor, as a model produces them.
    qkv = torch.randn(21, 2 * NUM_KV_HEADS + 4, HEAD_DIM, generator=gen).to(dtype)
    k, v = qkv[:, 4 : 4 + NUM_KV_HEADS], qkv[:, 4 + NUM_KV_HEADS :]
    slots = torch.randperm(NUM_PAGES * BLOCK_SIZE, generator=gen)[:21]
    pages = [torch.zeros(NUM_PAGES, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype) for _ in range(4)]
    kernels.store_kv(k, v, pages[0], pages[1], slots, backend="triton")
    kernels.store_kv(k, v, pages[2], pages[3], slots, backend="torch")
    assert torch.equal(pages[0], pages[2]) and torch.equal(pages[1], pages[3])
    assert pages[0].flatten(0, 1)[slots].equal(k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gather_and_scatter_blocks_equal_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    pages = torch.randn(NUM_PAGES, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    page_ids = torch.tensor([7, 0, 3, 8], dtype=torch.int64)
    staged = kernels.gather_blocks(pages, page_ids, backend="triton")
    assert torch.equal(staged, kernels.gather_blocks(pages, page_ids, backend="torch"))
    src = torch.randn(4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    ours, theirs = pages.clone(), pages.clone()
    kernels.scatter_blocks(src, ours, page_ids, backend="triton")
    kernels.scatter_blocks(src, theirs, page_ids, backend="torch")
    assert torch.equal(ours, theirs) and torch.equal(ours[page_ids], src)


def test_empty_inputs_are_no_ops() -> None:
    pages = torch.randn(NUM_PAGES, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    before = pages.clone()
    none = torch.empty(0, dtype=torch.int64)
    assert kernels.gather_blocks(pages, none, backend="triton").shape == (0, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    kernels.scatter_blocks(pages[:0], pages, none, backend="triton")
    empty_kv = torch.empty(0, NUM_KV_HEADS, HEAD_DIM)
    kernels.store_kv(empty_kv, empty_kv, pages, pages, none, backend="triton")
    assert torch.equal(pages, before)


def test_store_kv_skips_negative_slots() -> None:
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(3, NUM_KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
    pages = [torch.zeros(NUM_PAGES, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM) for _ in range(2)]
    slots = torch.tensor([5, -1, 17], dtype=torch.int64)
    kernels.store_kv(k, v, pages[0], pages[1], slots, backend="triton")
    flat_k, flat_v = pages[0].flatten(0, 1), pages[1].flatten(0, 1)
    assert torch.equal(flat_k[[5, 17]], k[[0, 2]]) and torch.equal(flat_v[[5, 17]], v[[0, 2]])
    assert int((flat_k != 0).any(dim=(1, 2)).sum()) == 2, "the padding row wrote nothing"
