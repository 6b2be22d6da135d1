"""The MoE experts on CUDA: the grouped path (torch._grouped_mm, bf16, no host synchronisation) against the
per-expert loop (the torch reference) on the device."""

from __future__ import annotations

import pytest
import torch

from mooncaked.model.moe import is_grouped_mm_supported, run_experts, run_experts_reference

pytestmark = pytest.mark.gpu

HIDDEN, INTER, NUM_EXPERTS, TOP_K = 256, 128, 16, 4


@pytest.mark.parametrize("num_tokens", [1, 7, 256])
def test_grouped_experts_equal_the_loop_on_cuda(num_tokens: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to("cuda", torch.bfloat16)
    gate_up = (torch.randn(NUM_EXPERTS, HIDDEN, 2 * INTER, generator=gen) * 0.05).to("cuda", torch.bfloat16)
    down = (torch.randn(NUM_EXPERTS, INTER, HIDDEN, generator=gen) * 0.05).to("cuda", torch.bfloat16)
    logits = torch.randn(num_tokens, NUM_EXPERTS, generator=gen).cuda()
    weights, expert_ids = torch.topk(torch.softmax(logits, dim=-1), TOP_K, dim=-1)
    assert is_grouped_mm_supported(x, gate_up)
    grouped = run_experts(x, weights, expert_ids, gate_up, down, 0, NUM_EXPERTS)
    loop = run_experts_reference(x, weights, expert_ids, gate_up, down, 0, NUM_EXPERTS)
    torch.testing.assert_close(grouped.float(), loop.float(), atol=2e-2, rtol=2e-2)
