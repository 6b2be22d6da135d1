"""The Triton kernels over compressed KV pages (int8, fp8_e4m3) compiled for the CUDA device, in fp16 and bf16:
the same packed bytes as the torch path's quantize, attention close to the torch path's over those bytes."""

from __future__ import annotations

import pytest
import torch

from mooncaked import kernels
from mooncaked.kernels.quantized_kv import quantize
from tests.gpu.test_kernels_cuda import BLOCK_SIZE, HEAD_DIM, NUM_NEW, SCALE, SEQ_LENS, TOLERANCE, on_cuda
from tests.kernels.paged_case import make_case

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]
PAGES_DTYPES = [torch.uint8, torch.float8_e4m3fn]


@pytest.mark.parametrize("pages_dtype", PAGES_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_on_device_packs_as_the_torch_path(dtype: torch.dtype, pages_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    qkv = (torch.randn(21, 10, HEAD_DIM, generator=gen) * 3).to(dtype).cuda()
    k, v = qkv[:, 4:7], qkv[:, 7:]  # strided views, as the model produces them
    slots = torch.randperm(9 * BLOCK_SIZE, generator=gen)[:21].cuda()
    slots[3] = -1  # a padding row of a captured decode step: skipped
    pages = [torch.zeros(9, BLOCK_SIZE, 3, HEAD_DIM + 2, dtype=pages_dtype, device="cuda") for _ in range(4)]
    kernels.store_kv(k, v, pages[0], pages[1], slots, backend="triton")
    keep = slots >= 0
    kernels.store_kv(k[keep], v[keep], pages[2], pages[3], slots[keep], backend="torch")
    for ours, theirs in ((pages[0], pages[2]), (pages[1], pages[3])):
        assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))


@pytest.mark.parametrize("pages_dtype", PAGES_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_over_packed_pages_on_device(dtype: torch.dtype, pages_dtype: torch.dtype) -> None:
    case = on_cuda(make_case(SEQ_LENS, NUM_NEW, 32, 8, HEAD_DIM, BLOCK_SIZE, dtype))
    k8, v8 = quantize(case.k_pages, pages_dtype).contiguous(), quantize(case.v_pages, pages_dtype).contiguous()
    tol = TOLERANCE[dtype]
    args = (case.q, k8, v8, case.block_tables, case.cu_seqlens_q, case.seq_lens, SCALE)
    out = kernels.prefill_attention(*args, backend="triton")
    assert out.is_cuda and out.dtype == dtype
    torch.testing.assert_close(out.float(), kernels.prefill_attention(*args, backend="torch").float(),
                               atol=tol, rtol=tol)
    last = (case.cu_seqlens_q[1:] - 1).long()  # each sequence's last query, as a decode step
    decode_args = (case.q[last].contiguous(), k8, v8, case.block_tables, case.seq_lens, SCALE)
    torch.testing.assert_close(kernels.decode_attention(*decode_args, backend="triton").float(),
                               kernels.decode_attention(*decode_args, backend="torch").float(), atol=tol, rtol=tol)
