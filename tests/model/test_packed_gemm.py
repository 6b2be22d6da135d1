"""MKL-packed GEMM: equal to torch.matmul at every decode row count, used only where it should be."""

from __future__ import annotations

import pytest
import torch

from mooncaked.model import packed_gemm
from mooncaked.model.llama import Linear
from mooncaked.model.loader import load_model
from mooncaked.model.packed_gemm import PACKED_MAX_ROWS

pytestmark = pytest.mark.skipif(not packed_gemm.is_available(), reason="this torch build has no MKL packed GEMM")


def _linear(in_features: int, out_features: int, seed: int = 0) -> Linear:
    linear = Linear(in_features, out_features, torch.float32, "cpu")
    with torch.no_grad():
        linear.weight_t.copy_(torch.randn(in_features, out_features, generator=torch.Generator().manual_seed(seed)))
    return linear


@pytest.mark.parametrize("shape", [(64, 96), (96, 37), (13, 200)])
@pytest.mark.parametrize("num_rows", [1, 3, 8, 17, PACKED_MAX_ROWS])
def test_packed_matmul_equals_matmul(shape: tuple[int, int], num_rows: int) -> None:
    linear = _linear(*shape)
    assert linear.pack_for_cpu()
    x = torch.randn(num_rows, shape[0])
    expected = torch.matmul(x, linear.weight_t)
    torch.testing.assert_close(linear(x), expected, rtol=1e-5, atol=1e-5)
    residual = torch.randn(num_rows, shape[1])
    torch.testing.assert_close(linear.forward_add(x, residual), expected + residual, rtol=1e-5, atol=1e-5)


def test_rows_above_the_limit_take_the_plain_weight() -> None:
    linear = _linear(32, 48)
    assert linear.pack_for_cpu()
    with torch.no_grad():
        linear.weight_t.mul_(2.0)  # the packed copy is now stale: only the plain path sees the change
    many, few = torch.randn(PACKED_MAX_ROWS + 1, 32), torch.randn(4, 32)
    torch.testing.assert_close(linear(many), many @ linear.weight_t)
    torch.testing.assert_close(linear(few), few @ (linear.weight_t / 2.0), rtol=1e-5, atol=1e-5)


def test_only_fp32_cpu_weights_are_packed() -> None:
    assert packed_gemm.pack(torch.randn(8, 8, dtype=torch.float16)) is None
    assert packed_gemm.pack(torch.randn(8, 8, dtype=torch.bfloat16)) is None
    linear = Linear(8, 8, torch.bfloat16, "cpu")
    assert not linear.pack_for_cpu() and linear.packed is None


def test_loader_packs_unless_told_not_to() -> None:
    packed = load_model("random:tiny", seed=11)
    plain = load_model("random:tiny", seed=11, cpu_packed_gemm=False)
    assert packed is not plain
    assert packed.model.lm_head.packed is not None
    assert plain.model.lm_head.packed is None
    ids = torch.tensor([5, 6, 7])
    with torch.inference_mode():
        hidden = [m.model.embed(ids) for m in (packed, plain)]
        torch.testing.assert_close(packed.model.compute_logits(hidden[0]), plain.model.compute_logits(hidden[1]),
                                   rtol=1e-5, atol=1e-5)
