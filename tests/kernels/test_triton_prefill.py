"""Triton prefill attention (interpreter on CPU) against the torch reference."""

import pytest
import torch

from mooncaked import kernels
from mooncaked.kernels import triton_prefill
from mooncaked.kernels.triton_prefill import PrefillTiles
from tests.kernels.paged_case import PagedCase, make_case, naive_attention
from tests.triton_mode import needs_triton_interpreter

pytestmark = needs_triton_interpreter

HEAD_DIM = 16
BLOCK_SIZE = 16
SCALE = HEAD_DIM**-0.5
# Ragged: no prefix (37), prefix of 80 (20 new), one new token after 4, exactly four blocks with no prefix.
SEQ_LENS = [37, 100, 5, 64]
NUM_NEW = [37, 20, 1, 64]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}


def _reference(case: PagedCase) -> torch.Tensor:
    return kernels.prefill_attention(
        case.q, case.k_pages, case.v_pages, case.block_tables, case.cu_seqlens_q, case.seq_lens, SCALE,
        backend="torch",
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (6, 2), (8, 1)])
def test_prefill_matches_reference(dtype: torch.dtype, num_heads: int, num_kv_heads: int) -> None:
    case = make_case(SEQ_LENS, NUM_NEW, num_heads, num_kv_heads, HEAD_DIM, BLOCK_SIZE, dtype)
    out = kernels.prefill_attention(
        case.q, case.k_pages, case.v_pages, case.block_tables, case.cu_seqlens_q, case.seq_lens, SCALE,
        backend="triton",
    )
    assert out.dtype == dtype and out.shape == case.q.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), _reference(case).float(), atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "tiles",
    [
        PrefillTiles(block_m=16, block_n=16, num_warps=4, num_stages=1),  # tile == page
        PrefillTiles(block_m=32, block_n=8, num_warps=4, num_stages=1),  # two tiles per page
        PrefillTiles(block_m=16, block_n=32, num_warps=4, num_stages=1),  # one tile spans two pages
    ],
)
def test_prefill_tile_and_page_sizes(tiles: PrefillTiles) -> None:
    # A fifth sequence has no new tokens (fully cached): it owns no tiles and no output rows.
    case = make_case(SEQ_LENS + [20], NUM_NEW + [0], 6, 2, HEAD_DIM, BLOCK_SIZE, torch.float32, seed=3)
    out = triton_prefill.prefill_attention(
        case.q, case.k_pages, case.v_pages, case.block_tables, case.cu_seqlens_q, case.seq_lens, SCALE, tiles
    )
    torch.testing.assert_close(out, _reference(case), atol=1e-5, rtol=1e-5)


def test_prefill_head_dim_not_a_power_of_two() -> None:
    case = make_case([50, 21], [50, 9], 6, 3, 24, 8, torch.float32, seed=4)
    out = kernels.prefill_attention(
        case.q, case.k_pages, case.v_pages, case.block_tables, case.cu_seqlens_q, case.seq_lens, 24**-0.5,
        backend="triton",
    )
    expected = kernels.prefill_attention(
        case.q, case.k_pages, case.v_pages, case.block_tables, case.cu_seqlens_q, case.seq_lens, 24**-0.5,
        backend="torch",
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sliding_window", [1, 5, 16, 33, 500])  # below, at, above a tile; longer than all
@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 8), (16, 32)])
def test_prefill_sliding_window(sliding_window: int, block_m: int, block_n: int) -> None:
    case = make_case(SEQ_LENS, NUM_NEW, 6, 2, HEAD_DIM, BLOCK_SIZE, torch.float32, seed=6)
    tiles = PrefillTiles(block_m=block_m, block_n=block_n, num_warps=4, num_stages=1)
    out = triton_prefill.prefill_attention(case.q, case.k_pages, case.v_pages, case.block_tables,
                                           case.cu_seqlens_q, case.seq_lens, SCALE, tiles, sliding_window)
    expected = naive_attention(case, SCALE, sliding_window)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
