"""int8 KV rows: the round trip's error bound (hypothesis), attention over int8 pages against attention over the
exact values those pages hold, and the dispatcher's checks."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from mooncaked import kernels
from mooncaked.kernels import reference
from mooncaked.kernels.quantized_kv import dequantize, quantize, rotate, rotation
from tests.kernels.paged_case import PagedCase, make_case, naive_attention

HEAD_DIM = 16
SCALE = HEAD_DIM**-0.5


@settings(max_examples=200, deadline=None)
@given(arrays("float32", (3, 2, 16), elements=st.floats(-1e4, 1e4, width=32)))
def test_round_trip_error_is_at_most_half_a_step(values: np.ndarray) -> None:
    x = torch.from_numpy(values)
    packed = quantize(x)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 2, 18)
    back = dequantize(packed, torch.float32)
    step = x.abs().amax(dim=-1, keepdim=True) / 127
    # half a step, plus what the bfloat16 scale's rounding (2^-9 relative) clips at the largest value
    assert bool(((x - back).abs() <= step * (0.5 + 127 * 2**-8) + 1e-30).all())
    assert bool((back[x.abs().amax(dim=-1) == 0] == 0).all())


@settings(max_examples=200, deadline=None)
@given(arrays("float32", (3, 2, 16), elements=st.floats(-1e4, 1e4, width=32)))
def test_fp8_round_trip_error_is_relative(values: np.ndarray) -> None:
    x = torch.from_numpy(values)
    packed = quantize(x, torch.float8_e4m3fn)
    assert packed.dtype == torch.float8_e4m3fn and packed.shape == (3, 2, 18)
    back = dequantize(packed, torch.float32)
    amax = x.abs().amax(dim=-1, keepdim=True)
    # e4m3 keeps 3 mantissa bits (half a step: 1/16 of the value), subnormals below 2^-6 of 448 steps of the
    # scale, and the bfloat16 scale's rounding (2^-9 relative) may clip the largest value by a step
    assert bool(((x - back).abs() <= x.abs() / 16 + amax / 256 + 1e-30).all())


def test_the_row_layout_is_kv_cache_dtype_s() -> None:
    from mooncaked.kernels.quantized_kv import INT8_SCALE_BYTES
    from mooncaked.kv import cache_dtype

    assert INT8_SCALE_BYTES == cache_dtype.INT8_SCALE_BYTES and cache_dtype.row_width(16, "int8") == 18


def _packed(case: PagedCase, pages_dtype: torch.dtype = torch.uint8) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize(case.k_pages, pages_dtype).contiguous(), quantize(case.v_pages, pages_dtype).contiguous()


@pytest.mark.parametrize("pages_dtype", [torch.uint8, torch.float8_e4m3fn])
@pytest.mark.parametrize("seq_lens,num_new", [([37, 100, 5], [37, 20, 1]), ([64], [64])])
def test_prefill_over_packed_pages_equals_attention_over_their_values(seq_lens: list[int], num_new: list[int],
                                                                      pages_dtype: torch.dtype) -> None:
    case = make_case(seq_lens, num_new, 6, 2, HEAD_DIM, 16, torch.float32)
    k8, v8 = _packed(case, pages_dtype)
    out = kernels.prefill_attention(case.q, k8, v8, case.block_tables, case.cu_seqlens_q, case.seq_lens, SCALE,
                                    backend="torch")
    exact = dataclasses.replace(case, k_pages=dequantize(k8, torch.float32), v_pages=dequantize(v8, torch.float32))
    torch.testing.assert_close(out.double(), naive_attention(exact, SCALE), atol=1e-5, rtol=1e-5)
    # and close to the unquantized: int8's error is absolute (max/254), e4m3's relative (1/16 of each value)
    assert (out.double() - naive_attention(case, SCALE)).abs().max() < (0.05 if pages_dtype == torch.uint8 else 0.15)


@pytest.mark.parametrize("pages_dtype", [torch.uint8, torch.float8_e4m3fn])
def test_decode_store_and_scatter_over_packed_pages(pages_dtype: torch.dtype) -> None:
    case = make_case([37, 100, 1, 64], [1] * 4, 4, 2, HEAD_DIM, 16, torch.float32)
    k8, v8 = _packed(case, pages_dtype)
    plan = kernels.plan_decode_attention(case.block_tables, case.seq_lens, 16, torch.float32, "torch")
    out = kernels.decode_attention(case.q, k8, v8, case.block_tables, case.seq_lens, SCALE, "torch", plan)
    exact = dataclasses.replace(case, k_pages=dequantize(k8, torch.float32), v_pages=dequantize(v8, torch.float32))
    torch.testing.assert_close(out.double(), naive_attention(exact, SCALE), atol=1e-5, rtol=1e-5)
    k = torch.randn(3, 2, HEAD_DIM)
    slots = torch.tensor([0, 17, 5])
    kernels.store_kv(k, k, k8, v8, slots, "torch")
    stored = k8.view(-1, 2, HEAD_DIM + 2)[slots]
    assert torch.equal(stored.view(torch.uint8), quantize(k, pages_dtype).view(torch.uint8))
    with pytest.raises(ValueError, match="k, v must be"):
        kernels.store_kv(torch.randn(3, 2, HEAD_DIM + 2), torch.randn(3, 2, HEAD_DIM + 2), k8, v8, slots, "torch")
    rows = reference.gather_blocks(k8, torch.tensor([1, 2]))  # staging moves the packed bytes
    assert rows.dtype == pages_dtype
    reference.scatter_blocks(rows, k8, torch.tensor([4, 5]))
    assert torch.equal(k8[4:6].view(torch.uint8), rows.view(torch.uint8))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 640))
def test_the_rotation_is_orthogonal_for_any_head_dim(head_dim: int) -> None:
    matrix = rotation(head_dim)
    assert matrix.shape == (head_dim, head_dim)
    assert torch.allclose(matrix @ matrix.T, torch.eye(head_dim), atol=1e-5)


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([64, 128, 576]))
def test_rotating_rows_with_outlier_channels_shrinks_int8_error(seed: int, head_dim: int) -> None:
    """Keys with a few channels 20x the rest (as LLM keys have): the rotated row's max |x| is far smaller, so is
    int8's step; measured as the error of the values after rotating back."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(32, head_dim, generator=generator)
    rows[:, torch.randperm(head_dim, generator=generator)[:3]] *= 20.0
    matrix = rotation(head_dim)
    direct = (dequantize(quantize(rows), torch.float32) - rows).pow(2).mean()
    rotated = (rotate(dequantize(quantize(rotate(rows, matrix)), torch.float32), matrix.T) - rows).pow(2).mean()
    assert rotated < 0.5 * direct


def test_rotate_computes_in_float32_and_keeps_the_dtype() -> None:
    x = torch.randn(5, 3, 64).to(torch.bfloat16)
    matrix = rotation(64)
    assert rotate(x, matrix).dtype == torch.bfloat16
    assert torch.allclose(rotate(rotate(x, matrix), matrix.T).float(), x.float(), atol=0.05)
    with pytest.raises(ValueError, match="head_dim"):
        rotation(0)
