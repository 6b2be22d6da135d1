"""The dispatch functions in mooncaked.kernels: backend choice and input errors."""

import pytest
import torch

from mooncaked import kernels
from tests.kernels.paged_case import make_case


def test_auto_on_cpu_is_the_torch_reference() -> None:
    assert kernels.resolve_backend("auto", torch.empty(1)) == "torch"
    assert kernels.resolve_backend("triton", torch.empty(1)) == "triton"


def test_unknown_backend_is_named() -> None:
    case = make_case([5], [5], 2, 2, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="'cuda-magic'"):
        kernels.decode_attention(
            case.q[:1], case.k_pages, case.v_pages, case.block_tables, case.seq_lens, 1.0, backend="cuda-magic"
        )


def test_auto_prefill_runs_the_reference_on_cpu() -> None:
    case = make_case([30, 12], [10, 12], 4, 2, 16, 16, torch.float32)
    args = (case.q, case.k_pages, case.v_pages, case.block_tables, case.cu_seqlens_q, case.seq_lens, 0.25)
    assert torch.equal(kernels.prefill_attention(*args), kernels.prefill_attention(*args, backend="torch"))


def test_decode_plan_is_the_torch_backends_only() -> None:
    case = make_case([30, 12], [1, 1], 4, 2, 16, 16, torch.float32)
    assert kernels.plan_decode_attention(case.block_tables, case.seq_lens, 16, torch.float32, "triton") is None
    plan = kernels.plan_decode_attention(case.block_tables, case.seq_lens, 16, torch.float32)
    args = (case.q, case.k_pages, case.v_pages, case.block_tables, case.seq_lens, 0.25)
    assert torch.equal(kernels.decode_attention(*args, plan=plan), kernels.decode_attention(*args))
    with pytest.raises(ValueError, match="seq_lens"):
        kernels.plan_decode_attention(case.block_tables, case.seq_lens[:1], 16, torch.float32)


def test_bad_shapes_raise_clear_errors() -> None:
    case = make_case([5], [5], 4, 2, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        kernels.prefill_attention(
            case.q[:, :3], case.k_pages, case.v_pages, case.block_tables, case.cu_seqlens_q, case.seq_lens, 1.0
        )
    with pytest.raises(ValueError, match="dtype"):
        kernels.prefill_attention(
            case.q.half(), case.k_pages, case.v_pages, case.block_tables, case.cu_seqlens_q, case.seq_lens, 1.0
        )
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        kernels.prefill_attention(
            case.q, case.k_pages, case.v_pages, case.block_tables, case.seq_lens, case.seq_lens, 1.0
        )
    with pytest.raises(ValueError, match="one row per sequence"):
        kernels.decode_attention(case.q, case.k_pages, case.v_pages, case.block_tables, case.seq_lens, 1.0)
    with pytest.raises(ValueError, match="slot_mapping"):
        kv = torch.zeros(3, 2, 16)
        kernels.store_kv(kv, kv, case.k_pages, case.v_pages, torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="src must be"):
        kernels.scatter_blocks(case.k_pages[:2], case.k_pages, torch.tensor([0]))


@pytest.mark.parametrize("sliding_window", [0, -3, True])
def test_bad_sliding_window_is_named(sliding_window: int) -> None:
    case = make_case([5], [5], 4, 2, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="sliding_window must be None or a positive"):
        kernels.prefill_attention(case.q, case.k_pages, case.v_pages, case.block_tables, case.cu_seqlens_q,
                                  case.seq_lens, 1.0, sliding_window=sliding_window)
    with pytest.raises(ValueError, match="sliding_window must be None or a positive"):
        kernels.plan_decode_attention(case.block_tables, case.seq_lens, 16, torch.float32,
                                      sliding_window=sliding_window)
