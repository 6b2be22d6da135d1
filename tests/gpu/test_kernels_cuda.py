"""Every Triton kernel compiled for the CUDA device, in fp16 and bf16, against its torch reference there."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mooncaked import kernels
from tests.kernels.paged_case import PagedCase, make_case

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
HEAD_DIM, BLOCK_SIZE = 64, 16
SCALE = HEAD_DIM**-0.5
SEQ_LENS, NUM_NEW = [37, 300, 5, 64], [37, 20, 1, 64]  # no prefix, a long prefix, one new token, whole pages


def on_cuda(case: PagedCase) -> PagedCase:
    return PagedCase(**{f.name: getattr(case, f.name).cuda() for f in dataclasses.fields(case)})


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_on_device_equals_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(21, 10, HEAD_DIM, generator=gen).to(dtype).cuda()
    k, v = qkv[:, 4:7], qkv[:, 7:]  # strided views, as the model produces them
    slots = torch.randperm(9 * BLOCK_SIZE, generator=gen)[:21].cuda()
    slots[3] = -1  # a padding row of a captured decode step: skipped
    pages = [torch.zeros(9, BLOCK_SIZE, 3, HEAD_DIM, dtype=dtype, device="cuda") for _ in range(4)]
    kernels.store_kv(k, v, pages[0], pages[1], slots, backend="triton")
    keep = slots >= 0
    kernels.store_kv(k[keep], v[keep], pages[2], pages[3], slots[keep], backend="torch")
    assert torch.equal(pages[0], pages[2]) and torch.equal(pages[1], pages[3])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_and_scatter_on_device_equal_reference(dtype: torch.dtype) -> None:
    pages = torch.randn(9, BLOCK_SIZE, 3, HEAD_DIM, device="cuda").to(dtype)
    page_ids = torch.tensor([7, 0, 3, 8], dtype=torch.int64, device="cuda")
    assert torch.equal(kernels.gather_blocks(pages, page_ids, "triton"), kernels.gather_blocks(pages, page_ids, "torch"))
    src = torch.randn(4, BLOCK_SIZE, 3, HEAD_DIM, device="cuda").to(dtype)
    ours, theirs = pages.clone(), pages.clone()
    kernels.scatter_blocks(src, ours, page_ids, "triton")
    kernels.scatter_blocks(src, theirs, page_ids, "torch")
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 8), (32, 8), (16, 1)])
def test_prefill_attention_on_device(dtype: torch.dtype, num_heads: int, num_kv_heads: int) -> None:
    case = on_cuda(make_case(SEQ_LENS, NUM_NEW, num_heads, num_kv_heads, HEAD_DIM, BLOCK_SIZE, dtype))
    args = (case.q, case.k_pages, case.v_pages, case.block_tables, case.cu_seqlens_q, case.seq_lens, SCALE)
    out = kernels.prefill_attention(*args, backend="triton")
    assert out.is_cuda and out.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), kernels.prefill_attention(*args, backend="torch").float(),
                               atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 8), (32, 8), (16, 1)])
def test_decode_attention_on_device(dtype: torch.dtype, num_heads: int, num_kv_heads: int) -> None:
    case = on_cuda(make_case(SEQ_LENS, [1] * len(SEQ_LENS), num_heads, num_kv_heads, HEAD_DIM, BLOCK_SIZE, dtype))
    args = (case.q, case.k_pages, case.v_pages, case.block_tables, case.seq_lens, SCALE)
    out = kernels.decode_attention(*args, backend="triton")
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), kernels.decode_attention(*args, backend="torch").float(),
                               atol=tol, rtol=tol)
