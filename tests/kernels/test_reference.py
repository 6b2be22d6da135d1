"""The torch reference kernels against naive dense attention and direct slot arithmetic."""

import pytest
import torch

from mooncaked.kernels import reference
from tests.kernels.paged_case import dense_kv, make_case, naive_attention

HEAD_DIM = 16
BLOCK_SIZE = 16
SCALE = HEAD_DIM**-0.5


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize(
    "seq_lens,num_new",
    [
        ([37], [37]),  # one sequence, no prefix
        ([37, 100, 5, 64], [37, 20, 1, 64]),  # ragged: no prefix, prefix, single token, exact blocks
    ],
)
def test_prefill_matches_dense(
    num_heads: int, num_kv_heads: int, seq_lens: list[int], num_new: list[int]
) -> None:
    case = make_case(seq_lens, num_new, num_heads, num_kv_heads, HEAD_DIM, BLOCK_SIZE, torch.float32)
    out = reference.prefill_attention(
        case.q, case.k_pages, case.v_pages, case.block_tables, case.cu_seqlens_q, case.seq_lens, SCALE
    )
    torch.testing.assert_close(out.double(), naive_attention(case, SCALE), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("seq_lens", [[37, 100, 1, 64], [300, 3, 17, 5]])  # padded; per sequence (long + short)
def test_decode_matches_dense(num_heads: int, num_kv_heads: int, seq_lens: list[int]) -> None:
    case = make_case(seq_lens, [1] * len(seq_lens), num_heads, num_kv_heads, HEAD_DIM, BLOCK_SIZE, torch.float32)
    out = reference.decode_attention(case.q, case.k_pages, case.v_pages, case.block_tables, case.seq_lens, SCALE)
    torch.testing.assert_close(out.double(), naive_attention(case, SCALE), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sliding_window", [1, 7, 16, 40, 500])  # one key, within a page, a page, pages, all
@pytest.mark.parametrize("seq_lens,num_new", [([37, 100, 5, 64], [37, 20, 1, 64]), ([90], [1])])
def test_sliding_window_prefill_matches_dense(sliding_window: int, seq_lens: list[int], num_new: list[int]) -> None:
    case = make_case(seq_lens, num_new, 6, 2, HEAD_DIM, BLOCK_SIZE, torch.float32, seed=1)
    out = reference.prefill_attention(case.q, case.k_pages, case.v_pages, case.block_tables, case.cu_seqlens_q,
                                      case.seq_lens, SCALE, sliding_window)
    torch.testing.assert_close(out.double(), naive_attention(case, SCALE, sliding_window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sliding_window", [1, 7, 16, 40, 500])
@pytest.mark.parametrize("seq_lens", [[37, 100, 1, 64], [300, 3, 17, 5], [40, 40, 40]])
def test_sliding_window_decode_matches_dense(sliding_window: int, seq_lens: list[int]) -> None:
    case = make_case(seq_lens, [1] * len(seq_lens), 6, 2, HEAD_DIM, BLOCK_SIZE, torch.float32, seed=2)
    plan = reference.plan_decode(case.block_tables, case.seq_lens, BLOCK_SIZE, torch.float32, sliding_window)
    out = reference.decode_attention(case.q, case.k_pages, case.v_pages, case.block_tables, case.seq_lens, SCALE,
                                     plan, sliding_window)
    torch.testing.assert_close(out.double(), naive_attention(case, SCALE, sliding_window), atol=1e-5, rtol=1e-5)
    # only the pages holding the window are gathered: at most ceil(W / B) + 1 per sequence
    widths = [plan.max_len] if not plan.parts else [part.max_len for part in plan.parts]
    assert max(widths) <= min(max(seq_lens), (sliding_window // BLOCK_SIZE + 2) * BLOCK_SIZE)


def test_decode_plan_for_another_window_is_rejected() -> None:
    case = make_case([20, 21], [1, 1], 4, 2, HEAD_DIM, BLOCK_SIZE, torch.float32)
    plan = reference.plan_decode(case.block_tables, case.seq_lens, BLOCK_SIZE, torch.float32, 8)
    with pytest.raises(ValueError, match="plan is for sliding window 8"):
        reference.decode_attention(case.q, case.k_pages, case.v_pages, case.block_tables, case.seq_lens, SCALE, plan)


@pytest.mark.parametrize("seq_lens", [[37, 100, 1, 64], [300, 3, 17, 5], [40, 40, 40]])
def test_decode_plan_reused_across_layers_equals_planning_each_call(seq_lens: list[int]) -> None:
    case = make_case(seq_lens, [1] * len(seq_lens), 6, 2, HEAD_DIM, BLOCK_SIZE, torch.float32)
    plan = reference.plan_decode(case.block_tables, case.seq_lens, BLOCK_SIZE, torch.float32)
    expected = naive_attention(case, SCALE)
    for pages_scale in (1.0, 0.5):  # two "layers": different page contents, one plan
        k_pages, v_pages = case.k_pages * pages_scale, case.v_pages * pages_scale
        planned = reference.decode_attention(case.q, k_pages, v_pages, case.block_tables, case.seq_lens, SCALE, plan)
        fresh = reference.decode_attention(case.q, k_pages, v_pages, case.block_tables, case.seq_lens, SCALE)
        torch.testing.assert_close(planned, fresh, atol=0, rtol=0)
    torch.testing.assert_close(
        reference.decode_attention(case.q, case.k_pages, case.v_pages, case.block_tables, case.seq_lens, SCALE,
                                   plan).double(), expected, atol=1e-5, rtol=1e-5)


def test_decode_plan_shapes() -> None:
    equal = make_case([40, 40], [1, 1], 4, 2, HEAD_DIM, BLOCK_SIZE, torch.float32)
    plan = reference.plan_decode(equal.block_tables, equal.seq_lens, BLOCK_SIZE, torch.float32)
    assert plan.mask is None and not plan.parts and plan.page_ids.shape == (2 * 3,)
    ragged = make_case([40, 30], [1, 1], 4, 2, HEAD_DIM, BLOCK_SIZE, torch.float32)
    plan = reference.plan_decode(ragged.block_tables, ragged.seq_lens, BLOCK_SIZE, torch.float32)
    assert plan.mask is not None and plan.mask.shape == (2, 1, 1, 40)
    assert bool(plan.mask[1, 0, 0, 29] == 0) and bool(plan.mask[1, 0, 0, 30] == float("-inf"))
    skewed = make_case([300, 3, 17, 5], [1] * 4, 4, 2, HEAD_DIM, BLOCK_SIZE, torch.float32)
    plan = reference.plan_decode(skewed.block_tables, skewed.seq_lens, BLOCK_SIZE, torch.float32)
    assert [p.max_len for p in plan.parts] == [300, 3, 17, 5]


def test_decode_plan_for_another_batch_is_rejected() -> None:
    case = make_case([20, 21], [1, 1], 4, 2, HEAD_DIM, BLOCK_SIZE, torch.float32)
    plan = reference.plan_decode(case.block_tables[:1], case.seq_lens[:1], BLOCK_SIZE, torch.float32)
    with pytest.raises(ValueError, match="plan is for 1 sequences"):
        reference.decode_attention(case.q, case.k_pages, case.v_pages, case.block_tables, case.seq_lens, SCALE, plan)


def test_store_kv_writes_each_token_at_its_slot() -> None:
    k_pages = torch.zeros(5, BLOCK_SIZE, 2, HEAD_DIM)
    v_pages = torch.zeros_like(k_pages)
    k, v = torch.randn(7, 2, HEAD_DIM), torch.randn(7, 2, HEAD_DIM)
    slots = torch.tensor([3, 17, 18, 79, 0, 40, 63])
    reference.store_kv(k, v, k_pages, v_pages, slots)
    for t, slot in enumerate(slots.tolist()):
        assert torch.equal(k_pages[slot // BLOCK_SIZE, slot % BLOCK_SIZE], k[t])
        assert torch.equal(v_pages[slot // BLOCK_SIZE, slot % BLOCK_SIZE], v[t])
    assert int((k_pages != 0).any(-1).any(-1).sum()) == 7


def test_store_kv_then_dense_read_round_trips() -> None:
    case = make_case([45], [45], 2, 2, HEAD_DIM, BLOCK_SIZE, torch.float32)
    block_table = case.block_tables[0]
    positions = torch.arange(45)
    slots = block_table[positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    k, v = torch.randn(45, 2, HEAD_DIM), torch.randn(45, 2, HEAD_DIM)
    reference.store_kv(k, v, case.k_pages, case.v_pages, slots)
    assert torch.equal(dense_kv(case.k_pages, block_table, 45), k)
    assert torch.equal(reference.gather_pages(case.v_pages, block_table, 45), v)


def test_gather_then_scatter_blocks() -> None:
    pages = torch.randn(6, BLOCK_SIZE, 2, HEAD_DIM)
    page_ids = torch.tensor([4, 0, 2])
    staged = reference.gather_blocks(pages, page_ids)
    assert staged.shape == (3, BLOCK_SIZE, 2, HEAD_DIM)
    assert all(torch.equal(staged[i], pages[p]) for i, p in enumerate(page_ids.tolist()))
    target = torch.zeros_like(pages)
    reference.scatter_blocks(staged, target, page_ids)
    assert torch.equal(target[page_ids], pages[page_ids])
    assert not target[[1, 3, 5]].any()
