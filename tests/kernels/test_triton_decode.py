"""Triton paged decode attention (interpreter on CPU) against the torch reference, with split-K."""

import pytest
import torch

from mooncaked import kernels
from mooncaked.kernels import triton_decode
from mooncaked.kernels.triton_decode import DecodeTiles
from tests.kernels.paged_case import PagedCase, make_case, naive_attention
from tests.triton_mode import needs_triton_interpreter

pytestmark = needs_triton_interpreter

HEAD_DIM = 16
BLOCK_SIZE = 16
SCALE = HEAD_DIM**-0.5
SEQ_LENS = [100, 37, 5, 1]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}


def _reference(case: PagedCase) -> torch.Tensor:
    return kernels.decode_attention(
        case.q, case.k_pages, case.v_pages, case.block_tables, case.seq_lens, SCALE, backend="torch"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (6, 2), (8, 1)])
def test_decode_matches_reference(dtype: torch.dtype, num_heads: int, num_kv_heads: int) -> None:
    case = make_case(SEQ_LENS, [1] * len(SEQ_LENS), num_heads, num_kv_heads, HEAD_DIM, BLOCK_SIZE, dtype)
    out = kernels.decode_attention(
        case.q, case.k_pages, case.v_pages, case.block_tables, case.seq_lens, SCALE, backend="triton"
    )
    assert out.dtype == dtype and out.shape == case.q.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), _reference(case).float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits", [4, 7])
def test_decode_split_k(dtype: torch.dtype, num_splits: int) -> None:
    # With 16-token tiles the 100-token sequence fills every split (chunks of 32 or 16 tokens), while the
    # 5- and 1-token sequences leave all but split 0 empty: both paths of the reduction run.
    case = make_case(SEQ_LENS, [1] * len(SEQ_LENS), 6, 2, HEAD_DIM, BLOCK_SIZE, dtype, seed=5)
    tiles = DecodeTiles(block_n=16, num_warps=4, num_stages=1, num_splits=num_splits)
    out = triton_decode.decode_attention(
        case.q, case.k_pages, case.v_pages, case.block_tables, case.seq_lens, SCALE, tiles
    )
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), _reference(case).float(), atol=tol, rtol=tol)


def test_num_splits_fill_the_device_but_stay_long() -> None:
    q = torch.empty(1, 32, 128)  # on CPU the heuristic assumes 4 SMs: 16 programs wanted
    assert triton_decode.choose_num_splits(q, num_kv_heads=1, max_tokens=32768) == 16
    assert triton_decode.choose_num_splits(q, num_kv_heads=8, max_tokens=32768) == 2
    assert triton_decode.choose_num_splits(q, num_kv_heads=1, max_tokens=300) == 2
    assert triton_decode.choose_num_splits(torch.empty(64, 32, 128), num_kv_heads=8, max_tokens=32768) == 1


@pytest.mark.parametrize("sliding_window", [1, 20, 64, 500])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_decode_sliding_window(sliding_window: int, num_splits: int | None) -> None:
    case = make_case(SEQ_LENS, [1] * len(SEQ_LENS), 6, 2, HEAD_DIM, BLOCK_SIZE, torch.float32, seed=7)
    tiles = DecodeTiles(block_n=16, num_warps=4, num_stages=1, num_splits=num_splits)
    out = triton_decode.decode_attention(case.q, case.k_pages, case.v_pages, case.block_tables, case.seq_lens,
                                         SCALE, tiles, sliding_window)
    torch.testing.assert_close(out.double(), naive_attention(case, SCALE, sliding_window), atol=1e-5, rtol=1e-5)
