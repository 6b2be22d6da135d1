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
    assert linear.weight_t is not None
    with torch.no_grad():
        linear.weight_t.copy_(torch.randn(in_features, out_features, generator=torch.Generator().manual_seed(seed)))
    return linear


@pytest.mark.parametrize("shape", [(64, 96), (96, 37), (13, 200)])
@pytest.mark.parametrize("num_rows", [1, 3, 8, 17, PACKED_MAX_ROWS])
def test_packed_matmul_equals_matmul(shape: tuple[int, int], num_rows: int) -> None:
    linear = _linear(*shape)
    assert linear.pack_for_cpu() and linear.weight_t is not None
    x = torch.randn(num_rows, shape[0])
    expected = torch.matmul(x, linear.weight_t)
    torch.testing.assert_close(linear(x), expected, rtol=1e-5, atol=1e-5)
    residual = torch.randn(num_rows, shape[1])
    torch.testing.assert_close(linear.forward_add(x, residual), expected + residual, rtol=1e-5, atol=1e-5)


def test_rows_above_the_limit_take_the_plain_weight() -> None:
    linear = _linear(32, 48)
    assert linear.pack_for_cpu() and linear.weight_t is not None
    with torch.no_grad():
        linear.weight_t.mul_(2.0)  # the packed copy is now stale: only the plain path sees the change
    many, few = torch.randn(PACKED_MAX_ROWS + 1, 32), torch.randn(4, 32)
    torch.testing.assert_close(linear(many), many @ linear.weight_t)
    torch.testing.assert_close(linear(few), few @ (linear.weight_t / 2.0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_a_replacing_pack_drops_the_plain_weight_and_serves_every_row_count(bias: bool) -> None:
    linear = _linear(48, 80, seed=3)
    assert linear.weight_t is not None
    plain = linear.weight_t.detach().clone()
    if bias:
        linear.bias = torch.nn.Parameter(torch.randn(80), requires_grad=False)
    assert linear.pack_for_cpu(is_replacing=True)
    assert linear.weight_t is None and linear.packed is not None
    assert linear.packed.weight.stride() == (0, 0)  # a placeholder: the plain weight's memory is released
    for num_rows in (1, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1, 300):
        x = torch.randn(num_rows, 48)
        expected = x @ plain + (linear.bias if linear.bias is not None else 0)
        torch.testing.assert_close(linear(x), expected, rtol=1e-5, atol=1e-4)
        residual = torch.randn(num_rows, 80)
        torch.testing.assert_close(linear.forward_add(x, residual), expected + residual, rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="plain weight was replaced by its packed copy"):
        linear.pack_for_cpu()


def test_only_fp32_cpu_weights_are_packed() -> None:
    assert packed_gemm.pack(torch.randn(8, 8, dtype=torch.float16)) is None
    assert packed_gemm.pack(torch.randn(8, 8, dtype=torch.bfloat16)) is None
    linear = Linear(8, 8, torch.bfloat16, "cpu")
    assert not linear.pack_for_cpu() and linear.packed is None


def test_loader_packs_unless_told_not_to() -> None:
    packed = load_model("random:tiny", seed=11)
    plain = load_model("random:tiny", seed=11, cpu_packed_gemm=False)
    assert packed is not plain
    assert packed.model.lm_head.packed is not None and packed.model.lm_head.weight_t is not None  # both copies
    assert plain.model.lm_head.packed is None
    assert load_model("random:tiny", seed=11, packing="plain").model.lm_head.packed is None
    replaced = load_model("random:tiny", seed=11, packing="packed").model
    assert replaced.lm_head.packed is not None and replaced.lm_head.weight_t is None
    assert replaced.weight_nbytes()["plain"] < packed.model.weight_nbytes()["plain"]
    ids = torch.tensor([5, 6, 7])
    with torch.inference_mode():
        hidden = [m.model.embed(ids) for m in (packed, plain)]
        torch.testing.assert_close(packed.model.compute_logits(hidden[0]), plain.model.compute_logits(hidden[1]),
                                   rtol=1e-5, atol=1e-5)
