"""The C kernel of routed experts (kernels/cpu_moe): equal to the per-expert torch loop over random shapes,
routings and expert-parallel shards (hypothesis), when the dispatcher takes it, and how its build fails."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncaked.kernels import cpu_moe
from mooncaked.model.moe import run_experts_reference


def test_the_kernel_builds_here_and_is_cached_by_its_source() -> None:
    assert cpu_moe.load() is not None, "gcc is installed here: the kernel must build"
    path = cpu_moe.build()
    assert path == cpu_moe.library_path() and path.exists() and path.parent == cpu_moe.BUILD_DIR
    assert cpu_moe.build() == path  # no second compile: the source's hash names the file


@settings(max_examples=150, deadline=None)
@given(num_tokens=st.integers(0, 40), num_experts=st.integers(1, 12), data=st.data(), hidden=st.integers(1, 70),
       inter=st.integers(1, 40), seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_the_kernel_equals_the_per_expert_loop(num_tokens: int, num_experts: int, data: st.DataObject, hidden: int,
                                              inter: int, seed: int, dtype: torch.dtype) -> None:
    """bf16 weights are read as bf16 and widened exactly: the fp32 loop over the same (rounded) values is the
    reference, and only the result's final rounding to bf16 differs."""
    top_k = data.draw(st.integers(1, num_experts))
    first = data.draw(st.integers(0, num_experts - 1))  # an expert-parallel shard: experts first .. last
    last = data.draw(st.integers(first, num_experts - 1))
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=generator).to(dtype)
    weights, ids = torch.rand(num_tokens, num_experts, generator=generator).softmax(-1).topk(top_k)
    gate_up = torch.randn(num_experts, hidden, 2 * inter, generator=generator).to(dtype)
    down = torch.randn(num_experts, inter, hidden, generator=generator).to(dtype)
    shard = slice(first, last + 1)
    got = cpu_moe.run_experts(x, weights, ids, gate_up[shard], down[shard], first)
    expected = run_experts_reference(x.float(), weights, ids, gate_up[shard].float(), down[shard].float(), first,
                                     num_experts)
    assert got.shape == x.shape and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-4)
    else:  # one rounding to bf16 (8 bits of mantissa) of the fp32 result
        torch.testing.assert_close(got.float(), expected, atol=1e-2, rtol=2 ** -7)


def test_views_are_made_contiguous_and_ids_may_be_int32() -> None:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(16, 6, generator=generator).t()  # [6, 16], not contiguous
    weights, ids = torch.rand(6, 4, generator=generator).topk(2)
    gate_up, down = torch.randn(4, 16, 10, generator=generator), torch.randn(4, 5, 16, generator=generator)
    expected = run_experts_reference(x.contiguous(), weights, ids, gate_up, down, 0, 4)
    torch.testing.assert_close(cpu_moe.run_experts(x, weights, ids.to(torch.int32), gate_up, down, 0), expected)


def test_a_token_naming_one_expert_twice_gets_it_twice() -> None:
    """Routers never repeat an expert in a token's top-k, but the kernel's scratch holds a row per (token, expert)
    pair, so repeated ids (every pair on expert 1) still sum like the torch loop instead of overrunning it."""
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(3, 8, generator=generator)
    ids, weights = torch.ones(3, 4, dtype=torch.int64), torch.full((3, 4), 0.25)
    gate_up, down = torch.randn(2, 8, 6, generator=generator), torch.randn(2, 3, 8, generator=generator)
    expected = run_experts_reference(x, weights, ids, gate_up, down, 0, 2)
    torch.testing.assert_close(cpu_moe.run_experts(x, weights, ids, gate_up, down, 0), expected)


def test_the_dispatcher_takes_the_kernel_for_fp32_and_bf16_decode_steps_only() -> None:
    gate_up = torch.zeros(2, 8, 4)
    assert cpu_moe.is_usable(torch.zeros(cpu_moe.MAX_TOKENS, 8), gate_up)
    assert not cpu_moe.is_usable(torch.zeros(cpu_moe.MAX_TOKENS + 1, 8), gate_up)  # a prefill chunk: torch
    assert cpu_moe.is_usable(torch.zeros(1, 8, dtype=torch.bfloat16), gate_up.bfloat16())
    assert not cpu_moe.is_usable(torch.zeros(1, 8, dtype=torch.bfloat16), gate_up)  # mixed dtypes: torch
    assert not cpu_moe.is_usable(torch.zeros(1, 8, dtype=torch.float16), gate_up.half())
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(cpu_moe.MAX_THREADS + 1)
        assert not cpu_moe.is_usable(torch.zeros(1, 8), gate_up)
    finally:
        torch.set_num_threads(threads)


def test_a_build_without_a_compiler_names_what_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(cpu_moe, "BUILD_DIR", tmp_path)
    monkeypatch.setattr(cpu_moe, "COMPILER", "no-such-compiler-here")
    with pytest.raises(RuntimeError, match="C compiler.*install gcc"):
        cpu_moe.build()
    assert list(tmp_path.iterdir()) == []


def test_a_failed_compile_leaves_no_library(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    broken = tmp_path / "cpu_moe.c"
    broken.write_text("int moe_experts( {\n")
    monkeypatch.setattr(cpu_moe, "SOURCE", broken)
    monkeypatch.setattr(cpu_moe, "BUILD_DIR", tmp_path / "build")
    with pytest.raises(RuntimeError, match="building cpu_moe.c failed"):
        cpu_moe.build()
    assert list((tmp_path / "build").iterdir()) == []
