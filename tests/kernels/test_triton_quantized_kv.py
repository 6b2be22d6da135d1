"""Triton kernels over compressed KV pages (int8, fp8_e4m3; interpreter on CPU) against the torch quantized path
and the uncompressed reference."""

from __future__ import annotations

import pytest
import torch

from mooncaked import kernels
from mooncaked.kernels.quantized_kv import quantize
from tests.kernels.paged_case import PagedCase, make_case
from tests.triton_mode import needs_triton_interpreter

pytestmark = needs_triton_interpreter

HEAD_DIM = 16
BLOCK_SIZE = 16
SCALE = HEAD_DIM**-0.5
PAGES_DTYPES = [torch.uint8, torch.float8_e4m3fn]
# Same packed bytes in both backends, so only the summation order differs (fp16: its rounding of q and K/V tiles)
BACKEND_TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}
# Against the uncompressed pages: int8's error is absolute (max/254 per row), e4m3's relative (1/16 per value)
COMPRESSION_TOLERANCE = {torch.uint8: 0.05, torch.float8_e4m3fn: 0.15}


def _packed_case(seq_lens: list[int], num_new: list[int], dtype: torch.dtype,
                 pages_dtype: torch.dtype) -> tuple[PagedCase, torch.Tensor, torch.Tensor]:
    case = make_case(seq_lens, num_new, 6, 2, HEAD_DIM, BLOCK_SIZE, dtype, seed=3)
    k8 = quantize(case.k_pages, pages_dtype).contiguous()
    v8 = quantize(case.v_pages, pages_dtype).contiguous()
    return case, k8, v8


@pytest.mark.parametrize("pages_dtype", PAGES_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_over_packed_pages(dtype: torch.dtype, pages_dtype: torch.dtype) -> None:
    case, k8, v8 = _packed_case([37, 80, 5], [37, 20, 1], dtype, pages_dtype)
    args = (case.q, k8, v8, case.block_tables, case.cu_seqlens_q, case.seq_lens, SCALE)
    out = kernels.prefill_attention(*args, backend="triton")
    assert out.dtype == dtype and out.shape == case.q.shape
    tol = BACKEND_TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), kernels.prefill_attention(*args, backend="torch").float(),
                               atol=tol, rtol=tol)
    exact = kernels.prefill_attention(case.q, case.k_pages, case.v_pages, case.block_tables, case.cu_seqlens_q,
                                      case.seq_lens, SCALE, backend="torch")
    assert (out.float() - exact.float()).abs().max() < COMPRESSION_TOLERANCE[pages_dtype]


@pytest.mark.parametrize("pages_dtype", PAGES_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_over_packed_pages(dtype: torch.dtype, pages_dtype: torch.dtype) -> None:
    case, k8, v8 = _packed_case([100, 37, 1], [1, 1, 1], dtype, pages_dtype)
    args = (case.q, k8, v8, case.block_tables, case.seq_lens, SCALE)
    out = kernels.decode_attention(*args, backend="triton")
    tol = BACKEND_TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), kernels.decode_attention(*args, backend="torch").float(),
                               atol=tol, rtol=tol)
    exact = kernels.decode_attention(case.q, case.k_pages, case.v_pages, case.block_tables, case.seq_lens, SCALE,
                                     backend="torch")
    assert (out.float() - exact.float()).abs().max() < COMPRESSION_TOLERANCE[pages_dtype]


@pytest.mark.parametrize("pages_dtype", PAGES_DTYPES)
def test_store_kv_quantizes_as_the_torch_path(pages_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    k = torch.randn(5, 2, HEAD_DIM, generator=gen) * torch.tensor([1.0, 1e-3]).view(1, 2, 1)
    k[3, 1, :4] = torch.tensor([127.0, 2.5, -0.5, 0.02])  # a row's max, an int8 tie, an e4m3 carry, a subnormal
    k[1, 0] = 0.0  # an all-zero row keeps scale 0
    v = torch.randn(5, 2, HEAD_DIM, generator=gen)
    slots = torch.tensor([0, 17, -1, 5, 40])  # -1: a padding row, written nowhere
    k8, v8 = (torch.zeros(3, BLOCK_SIZE, 2, HEAD_DIM + 2, dtype=pages_dtype) for _ in range(2))
    kernels.store_kv(k, v, k8, v8, slots, "triton")
    written = slots >= 0
    for pages, x in ((k8, k), (v8, v)):
        rows = pages.view(-1, 2, HEAD_DIM + 2)[slots[written]]
        expected = quantize(x[written], pages_dtype)
        # the scales' bytes equal torch's
        assert torch.equal(rows.view(torch.uint8)[..., HEAD_DIM:], expected.view(torch.uint8)[..., HEAD_DIM:])
        assert torch.equal(rows.view(torch.uint8), expected.view(torch.uint8))
    untouched = torch.ones(3 * BLOCK_SIZE, dtype=torch.bool)
    untouched[slots[written]] = False
    assert not bool(k8.view(torch.uint8).view(-1, 2, HEAD_DIM + 2)[untouched].any())


@pytest.mark.parametrize("pages_dtype", PAGES_DTYPES)
def test_gather_and_scatter_move_packed_bytes(pages_dtype: torch.dtype) -> None:
    pages = quantize(torch.randn(4, BLOCK_SIZE, 2, HEAD_DIM), pages_dtype).contiguous()
    staged = kernels.gather_blocks(pages, torch.tensor([3, 1]), "triton")
    assert staged.dtype == pages_dtype and torch.equal(staged.view(torch.uint8), pages[[3, 1]].view(torch.uint8))
    kernels.scatter_blocks(staged, pages, torch.tensor([0, 2]), "triton")
    assert torch.equal(pages[[0, 2]].view(torch.uint8), pages[[3, 1]].view(torch.uint8))
