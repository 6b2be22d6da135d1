"""The MoE MLP (model.moe, model.moe_routing): both router variants equal transformers' routers, the grouped expert
compute equals every expert computed densely, experts no token chose are never read, shards (column slices or
whole experts) add up to the whole, and the modules equal transformers' Qwen3-MoE and DeepSeek-V3 blocks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from mooncaked.model.config import ShardShape
from mooncaked.kernels import cpu_moe
from mooncaked.model.moe import (SparseMoE, run_experts, run_experts_grouped, run_experts_one_token,
                                  run_experts_reference)
from mooncaked.model.moe_args import MoEArgs
from mooncaked.model.moe_routing import route

transformers = pytest.importorskip("transformers")

RunExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int], torch.Tensor]
HIDDEN = 32
SOFTMAX = MoEArgs(num_experts=8, num_experts_per_token=2, intermediate_size=16, sparse_layers=(0,),
                  norm_topk_prob=True)
# DeepSeek-V3's router: 16 experts in 4 groups, 2 groups per token, 4 experts, a correction bias, scaled
SIGMOID = MoEArgs(num_experts=16, num_experts_per_token=4, intermediate_size=16, sparse_layers=(0,), scoring="sigmoid",
                  norm_topk_prob=True, num_groups=4, num_groups_per_token=2, routed_scaling_factor=2.5,
                  has_correction_bias=True, num_shared_experts=1)


def _whole(moe: MoEArgs) -> ShardShape:
    return ShardShape(num_heads=1, num_kv_heads=1, head_dim=2, intermediate_size=2, num_experts=moe.num_experts,
                      expert_intermediate_size=moe.intermediate_size,
                      shared_intermediate_size=moe.shared_intermediate_size)


def _hf_config(moe: MoEArgs) -> Any:
    if moe.scoring == "softmax":
        return transformers.Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=moe.num_experts,
                                           num_experts_per_tok=moe.num_experts_per_token,
                                           moe_intermediate_size=moe.intermediate_size,
                                           norm_topk_prob=moe.norm_topk_prob)
    return transformers.DeepseekV3Config(hidden_size=HIDDEN, n_routed_experts=moe.num_experts,
                                         num_experts_per_tok=moe.num_experts_per_token,
                                         moe_intermediate_size=moe.intermediate_size, n_group=moe.num_groups,
                                         topk_group=moe.num_groups_per_token, norm_topk_prob=moe.norm_topk_prob,
                                         routed_scaling_factor=moe.routed_scaling_factor,
                                         n_shared_experts=moe.num_shared_experts)


def _hf_block(moe: MoEArgs, seed: int) -> Any:
    """transformers' MoE block of `moe` with random weights (a non-zero correction bias)."""
    config = _hf_config(moe)
    if moe.scoring == "softmax":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
    else:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as Block
    block = Block(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in [*block.parameters(), *block.buffers()]:
            tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.3)
    return block


def _hf_tensors(block: Any, moe: MoEArgs) -> dict[str, torch.Tensor]:
    """The block's weights under checkpoint names (per-expert tensors, as checkpoints store them)."""
    state = block.state_dict()
    inter = moe.intermediate_size
    tensors = {"mlp.gate.weight": state["gate.weight"]}
    if moe.has_correction_bias:
        tensors["mlp.gate.e_score_correction_bias"] = state["gate.e_score_correction_bias"]
    for e in range(moe.num_experts):
        gate_up = state["experts.gate_up_proj"][e]  # [2I, H]
        tensors |= {f"mlp.experts.{e}.gate_proj.weight": gate_up[:inter], f"mlp.experts.{e}.up_proj.weight":
                    gate_up[inter:], f"mlp.experts.{e}.down_proj.weight": state["experts.down_proj"][e]}
    for name in ("gate_proj", "up_proj", "down_proj"):
        if f"shared_experts.{name}.weight" in state:
            tensors[f"mlp.shared_experts.{name}.weight"] = state[f"shared_experts.{name}.weight"]
    return tensors


def _ours(moe: MoEArgs, tensors: dict[str, torch.Tensor], shape: ShardShape | None = None) -> SparseMoE:
    module = SparseMoE(moe, HIDDEN, shape or _whole(moe), torch.float32, "cpu")
    targets = module.weight_targets("")
    with torch.no_grad():
        for name, target in targets.items():
            target.copy_from(tensors[name])
    return module


@pytest.mark.parametrize("moe", [SOFTMAX, replace(SOFTMAX, norm_topk_prob=False), SIGMOID,
                                 replace(SIGMOID, num_groups=1, num_groups_per_token=1, norm_topk_prob=False)],
                         ids=["softmax-renormalized", "softmax", "sigmoid-grouped", "sigmoid-ungrouped"])
def test_routing_equals_transformers_router(moe: MoEArgs) -> None:
    block = _hf_block(moe, seed=1)
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(2))
    _, hf_weights, hf_ids = block.gate(x)
    bias = getattr(block.gate, "e_score_correction_bias", None)
    weights, ids = route(F.linear(x, block.gate.weight), moe, bias if moe.has_correction_bias else None)
    hf_order, order = hf_ids.sort(dim=-1)[1], ids.sort(dim=-1)[1]  # transformers' DeepSeek top-k is unsorted
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    torch.testing.assert_close(weights.gather(1, order), hf_weights.float().gather(1, hf_order))


def test_group_limit_and_correction_bias_change_the_choice() -> None:
    """The routing test's router makes different choices without the group limit or the bias: they are exercised."""
    block = _hf_block(SIGMOID, seed=1)
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(2))
    logits = F.linear(x, block.gate.weight)
    bias = block.gate.e_score_correction_bias
    chosen = route(logits, SIGMOID, bias)[1].sort(dim=-1)[0]
    ungrouped = route(logits, replace(SIGMOID, num_groups=1, num_groups_per_token=1), bias)[1].sort(dim=-1)[0]
    unbiased = route(logits, SIGMOID, None)[1].sort(dim=-1)[0]
    assert not torch.equal(chosen, ungrouped) and not torch.equal(chosen, unbiased)


@pytest.mark.parametrize("moe", [SOFTMAX, SIGMOID], ids=["qwen3-moe-block", "deepseek-v3-block-shared-expert"])
@pytest.mark.parametrize("num_tokens", [1, 5, 64])
def test_module_equals_transformers_block(moe: MoEArgs, num_tokens: int) -> None:
    block = _hf_block(moe, seed=3)
    ours = _ours(moe, _hf_tensors(block, moe))
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(num_tokens))
    with torch.no_grad():
        expected = block(x.unsqueeze(0))[0]
    torch.testing.assert_close(ours(x), expected, atol=1e-5, rtol=1e-5)


def _dense_reference(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                     down: torch.Tensor) -> torch.Tensor:
    """Every expert over every token, masked by the routing: what run_experts must equal without computing it."""
    inter = down.shape[1]
    h = torch.einsum("th,ehi->eti", x, gate_up)  # [E, T, 2I]
    out = torch.einsum("eti,eih->eth", F.silu(h[..., :inter]) * h[..., inter:], down)  # [E, T, H]
    dense_weights = torch.zeros(x.shape[0], gate_up.shape[0]).scatter_add_(1, ids, weights)  # [T, E]
    return torch.einsum("te,eth->th", dense_weights, out)


def _experts(num_experts: int, inter: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_experts, HIDDEN, 2 * inter, generator=gen), torch.randn(num_experts, inter, HIDDEN,
                                                                                   generator=gen)


def _cpu_kernel(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                expert_offset: int, num_experts: int) -> torch.Tensor:
    return cpu_moe.run_experts(x, weights, ids, gate_up, down, expert_offset)


def _one_token_at_a_time(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                         down: torch.Tensor, expert_offset: int, num_experts: int) -> torch.Tensor:
    return torch.cat([run_experts_one_token(x[t:t + 1], weights[t:t + 1], ids[t:t + 1], gate_up, down, expert_offset)
                      for t in range(x.shape[0])])


EXPERT_PATHS = [run_experts, run_experts_grouped, run_experts_reference, _cpu_kernel, _one_token_at_a_time]
PATH_IDS = ["dispatch", "grouped-gemm", "per-expert-loop", "cpu-kernel", "one-token"]


@pytest.mark.parametrize("run", EXPERT_PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("num_tokens", [1, 3, 40])
def test_grouped_experts_equal_dense_reference_and_shards_add_up(num_tokens: int, run: RunExperts) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=gen)
    weights, ids = route(torch.randn(num_tokens, 8, generator=gen), SOFTMAX)
    gate_up, down = _experts(8, 16, seed=5)
    whole = run(x, weights, ids, gate_up, down, 0, 8)
    torch.testing.assert_close(whole, _dense_reference(x, weights, ids, gate_up, down), atol=1e-4, rtol=1e-5)
    # expert-parallel: ranks holding experts 0-3 and 4-7 whole
    ranks = [run(x, weights, ids, gate_up[r * 4:(r + 1) * 4], down[r * 4:(r + 1) * 4], r * 4, 8)
             for r in range(2)]
    torch.testing.assert_close(ranks[0] + ranks[1], whole, atol=1e-4, rtol=1e-5)
    # tensor-parallel: ranks holding columns 0-7 and 8-15 of every expert
    columns = [run(x, weights, ids, torch.cat([gate_up[..., c:c + 8], gate_up[..., 16 + c:24 + c]], -1),
                           down[:, c:c + 8], 0, 8) for c in (0, 8)]
    torch.testing.assert_close(columns[0] + columns[1], whole, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("run", EXPERT_PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("num_tokens", [1, 4])
def test_experts_no_token_chose_are_never_read(run: RunExperts, num_tokens: int) -> None:
    """NaN weights in every expert but the chosen ones: a dense pass (even masked by zero weights) would give NaN."""
    gate_up, down = _experts(8, 16, seed=6)
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(7))
    ids = torch.tensor([[1, 6], [6, 1], [1, 6], [6, 1]])[:num_tokens]
    weights = torch.full((num_tokens, 2), 0.5)
    unused = [e for e in range(8) if e not in (1, 6)]
    gate_up[unused], down[unused] = float("nan"), float("nan")
    out = run(x, weights, ids, gate_up, down, 0, 8)
    assert torch.isfinite(out).all() and out.abs().sum() > 0


@pytest.mark.parametrize("overrides, field", [
    ({"num_groups": 4, "num_groups_per_token": 5}, "topk_group"),
    ({"num_groups": 3}, "n_group"),
    ({"num_experts_per_token": 9}, "num_experts_per_tok"),
    ({"num_groups": 4, "num_groups_per_token": 1, "num_experts_per_token": 5}, "num_experts_per_tok"),
    ({"num_groups": 16, "num_groups_per_token": 2}, "n_group"),
    ({"intermediate_size": 0}, "moe_intermediate_size"),
    ({"routed_scaling_factor": float("inf")}, "routed_scaling_factor"),
    ({"num_experts": 1 << 20}, "num_experts"),
    ({"num_shared_experts": -1}, "n_shared_experts"),
    ({"scoring": "softmax", "num_groups": 2}, "n_group"),
])
def test_hostile_moe_fields_are_named(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        replace(SIGMOID, **overrides)
