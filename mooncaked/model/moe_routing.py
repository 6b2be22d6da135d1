"""Top-k expert routing: router logits -> each token's experts and their weights, as transformers computes them.

1. `route(logits, moe, correction_bias)` picks `moe.num_experts_per_token` experts per token with the router variant
   MoEArgs names (softmax, or sigmoid with a correction bias and group-limited choice: model.moe_args).
2. `group_by_expert(expert_ids, num_experts)` sorts the (token, slot) pairs by expert: the order, the token of
   each sorted row, and the rows per expert, so each expert runs once on a contiguous block of rows (model.moe).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mooncaked.model.moe_args import MoEArgs


def route(logits: torch.Tensor, moe: MoEArgs,
          correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights fp32 [T, K], expert ids int64 [T, K]); K = moe.num_experts_per_token."""
    logits = logits.float()
    if moe.scoring == "softmax":
        if moe.norm_topk_prob:  # softmax renormalized over the top k = softmax of the top k logits (2 ops, not 4)
            top_logits, expert_ids = torch.topk(logits, moe.num_experts_per_token, dim=-1)
            weights = torch.softmax(top_logits, dim=-1)
        else:
            weights, expert_ids = torch.topk(torch.softmax(logits, dim=-1), moe.num_experts_per_token, dim=-1)
        return weights * moe.routed_scaling_factor if moe.routed_scaling_factor != 1.0 else weights, expert_ids
    scores = torch.sigmoid(logits)  # [T, E]
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if moe.num_groups > 1:
        choice = _limit_to_best_groups(choice, moe)
    expert_ids = torch.topk(choice, moe.num_experts_per_token, dim=-1, sorted=False)[1]
    weights = scores.gather(1, expert_ids)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, expert_ids


def _limit_to_best_groups(choice: torch.Tensor, moe: MoEArgs) -> torch.Tensor:
    """choice [T, E] with the experts outside each token's topk_group best groups set to -inf; a group's score is
    the sum of its two best experts' (DeepSeek-V3)."""
    num_tokens = choice.shape[0]
    grouped = choice.view(num_tokens, moe.num_groups, -1)  # [T, G, E / G]
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
    best_groups = torch.topk(group_scores, moe.num_groups_per_token, dim=-1, sorted=False)[1]  # [T, topk_group]
    is_kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)  # [T, G]
    return grouped.masked_fill(~is_kept.unsqueeze(-1), float("-inf")).view(num_tokens, -1)


@dataclass(frozen=True)
class ExpertGroups:
    """The T * K (token, slot) pairs of a step sorted by expert."""

    order: torch.Tensor  # int64 [T * K]: sorted row i is flat pair order[i] (pair = token * K + slot)
    token_of_row: torch.Tensor  # int64 [T * K]: the token of each sorted row
    rows_per_expert: torch.Tensor  # int64 [E]: how many sorted rows each expert has (the rows are contiguous)


def group_by_expert(expert_ids: torch.Tensor, num_experts: int) -> ExpertGroups:
    """expert_ids int64 [T, K] (ids in [0, num_experts)) -> the pairs sorted by expert, stable within an expert."""
    flat = expert_ids.flatten()
    order = torch.argsort(flat, stable=True)
    token_of_row = torch.div(order, expert_ids.shape[1], rounding_mode="floor")
    return ExpertGroups(order, token_of_row, torch.bincount(flat, minlength=num_experts))
