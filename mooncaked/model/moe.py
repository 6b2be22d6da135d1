"""The Mixture-of-Experts MLP both MoE families use (Qwen3-MoE, DeepSeek-V3), as a plain PyTorch module.

1. `SparseMoE(moe, hidden_size, shape, dtype, device)` allocates the router (every expert's logit column), the shard's routed
   experts (gate/up fused and transposed, [E_local, hidden, 2 * I]; down [E_local, I, hidden]) and, where the model
   has them, the shared experts (a dense MLP beside the routed ones). A tensor-parallel shard holds every expert's
   slice of I columns (ShardShape.expert_intermediate_*), an expert-parallel one whole experts
   (ShardShape.num_experts from expert_offset): either way its output is a partial sum the layer all-reduces.
2. `weight_targets(prefix)` maps the Hugging Face tensors (`mlp.gate.weight`, `mlp.experts.{e}.gate_proj.weight`,
   ..., `mlp.shared_experts.*`) into those parameters; another shard's experts have no target.
3. `forward(x)` routes every token (model.moe_routing), sorts the (token, expert) pairs by expert and runs each
   expert once on its block of rows (`run_experts`): a decode step on CPU in fp32 or bf16 (up to kernels.cpu_moe's
   MAX_TOKENS tokens and MAX_THREADS torch threads) through the C kernel, which reads each chosen expert's weights once at
   memory speed; else two grouped GEMMs (torch._grouped_mm: on CPU in fp32/bf16, an expert without rows is never
   read; on CUDA in bf16, with no host synchronisation), else a loop over the experts that got rows; without
   the kernel a single token on CPU runs its K experts directly. Cost follows the active parameters: no
   per-token loop and no dense pass over every expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mooncaked.kernels import cpu_moe
from mooncaked.model.config import ShardShape
from mooncaked.model.layers import Linear
from mooncaked.model.moe_args import MoEArgs
from mooncaked.model.moe_routing import group_by_expert, route
from mooncaked.model.weight_targets import WeightTarget, plain


class SparseMoE(nn.Module):
    def __init__(self, moe: MoEArgs, hidden: int, shape: ShardShape, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.moe = moe
        self.shape = shape
        inter = shape.expert_intermediate_size
        self.router = Linear(hidden, moe.num_experts, dtype, device)  # replicated on every shard
        self.correction_bias = nn.Parameter(torch.empty(moe.num_experts, dtype=dtype, device=device),
                                            requires_grad=False) if moe.has_correction_bias else None
        self.experts_gate_up = nn.Parameter(torch.empty(shape.num_experts, hidden, 2 * inter, dtype=dtype,
                                                        device=device), requires_grad=False)
        self.experts_down = nn.Parameter(torch.empty(shape.num_experts, inter, hidden, dtype=dtype, device=device),
                                         requires_grad=False)
        if torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16):
            cpu_moe.load()  # built (once per host and source) at model load, not in the first decode step
        self.shared_gate_up: Linear | None = None
        self.shared_down: Linear | None = None
        if shape.shared_intermediate_size:
            self.shared_gate_up = Linear(hidden, 2 * shape.shared_intermediate_size, dtype, device)
            self.shared_down = Linear(shape.shared_intermediate_size, hidden, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] (normed) -> this shard's part of the MLP output [T, hidden] (no residual)."""
        weights, expert_ids = route(self.router(x), self.moe, self.correction_bias)  # [T, K] each
        out = run_experts(x, weights, expert_ids, self.experts_gate_up, self.experts_down, self.shape.expert_offset,
                          self.moe.num_experts)
        if self.shared_gate_up is not None and self.shared_down is not None:
            gate, up = self.shared_gate_up(x).chunk(2, dim=-1)
            out = self.shared_down.forward_add(F.silu(gate).mul_(up), out)
        return out

    def weight_targets(self, p: str) -> dict[str, WeightTarget]:
        """Hugging Face tensor name (`p` is the layer's prefix) -> where it lands in this shard."""
        s = self.shape
        inter, rows = s.expert_intermediate_size, (s.expert_intermediate_offset, s.expert_intermediate_size)
        targets = {p + "mlp.gate.weight": WeightTarget(plain(self.router), is_transposed=True)}
        if self.correction_bias is not None:
            targets[p + "mlp.gate.e_score_correction_bias"] = WeightTarget(self.correction_bias)
        for local in range(s.num_experts):
            e = f"{p}mlp.experts.{s.expert_offset + local}."
            gate_up, down = self.experts_gate_up[local], self.experts_down[local]
            targets[e + "gate_proj.weight"] = WeightTarget(gate_up[:, :inter], True, (0, *rows))
            targets[e + "up_proj.weight"] = WeightTarget(gate_up[:, inter:], True, (0, *rows))
            targets[e + "down_proj.weight"] = WeightTarget(down, True, (1, *rows))
        if self.shared_gate_up is not None and self.shared_down is not None:
            shared = s.shared_intermediate_size
            shared_rows = (s.shared_intermediate_offset, shared)
            gate_up_t = plain(self.shared_gate_up)
            targets[p + "mlp.shared_experts.gate_proj.weight"] = WeightTarget(gate_up_t[:, :shared], True,
                                                                              (0, *shared_rows))
            targets[p + "mlp.shared_experts.up_proj.weight"] = WeightTarget(gate_up_t[:, shared:], True,
                                                                            (0, *shared_rows))
            targets[p + "mlp.shared_experts.down_proj.weight"] = WeightTarget(plain(self.shared_down), True,
                                                                              (1, *shared_rows))
        return targets


def run_experts(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, expert_offset: int, num_experts: int) -> torch.Tensor:
    """sum over each token's chosen experts held here (global ids expert_offset .. + E_local) of weight * expert(x).

    x [T, H]; weights fp32 [T, K]; expert_ids int64 [T, K] in [0, num_experts); gate_up [E_local, H, 2I];
    down [E_local, I, H] -> [T, H] in x's dtype.
    """
    if cpu_moe.is_usable(x, gate_up):  # a decode step on CPU (fp32, bf16): the C kernel streams each expert once
        return cpu_moe.run_experts(x, weights, expert_ids, gate_up, down, expert_offset)
    if x.shape[0] == 1 and not x.is_cuda:
        return run_experts_one_token(x, weights, expert_ids, gate_up, down, expert_offset)
    if not is_grouped_mm_supported(x, gate_up):
        return run_experts_reference(x, weights, expert_ids, gate_up, down, expert_offset, num_experts)
    return run_experts_grouped(x, weights, expert_ids, gate_up, down, expert_offset, num_experts)


def run_experts_grouped(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, gate_up: torch.Tensor,
                        down: torch.Tensor, expert_offset: int, num_experts: int) -> torch.Tensor:
    """`run_experts` as two grouped GEMMs over the (token, expert) rows sorted by expert (is_grouped_mm_supported)."""
    inter = gate_up.shape[2] // 2
    num_local = gate_up.shape[0]
    groups = group_by_expert(expert_ids, num_experts)
    order, tokens, local_counts = groups.order, groups.token_of_row, groups.rows_per_expert
    if num_local != num_experts:  # expert-parallel: this shard's experts' rows only (one host read)
        first_row = int(local_counts[:expert_offset].sum())
        local_counts = local_counts[expert_offset:expert_offset + num_local]
        rows_here = slice(first_row, first_row + int(local_counts.sum()))
        order, tokens = order[rows_here], tokens[rows_here]
    offsets = torch.cumsum(local_counts, dim=0, dtype=torch.int32)  # [E_local]: end row of each expert
    rows = x.index_select(0, tokens)  # [R, H]
    gate, up = torch._grouped_mm(rows, gate_up, offs=offsets).split(inter, dim=-1)  # [R, I] each
    out = torch._grouped_mm(F.silu(gate).mul_(up), down, offs=offsets)  # [R, H]
    row_weights = weights.flatten()[order].unsqueeze(1)  # [R, 1] fp32
    out.mul_(row_weights if out.dtype == torch.float32 else row_weights.to(out.dtype))
    return torch.zeros_like(x).index_add_(0, tokens, out)


def run_experts_one_token(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, gate_up: torch.Tensor,
                          down: torch.Tensor, expert_offset: int) -> torch.Tensor:
    """`run_experts` for one token on CPU (a batch-1 decode step): its K experts run directly, one GEMV pair and an
    accumulate each; no sort, grouping or scatter (~50-85 us less per layer than the grouped GEMMs, whose CPU
    kernel visits every expert's group, measured on hidden 512, 16 experts, top-4)."""
    inter, num_local = gate_up.shape[2] // 2, gate_up.shape[0]
    out = torch.zeros_like(x)  # [1, H]
    for expert, weight in zip(expert_ids[0].tolist(), weights[0].tolist()):  # host reads: CPU tensors, no sync
        local = expert - expert_offset
        if 0 <= local < num_local:  # another expert-parallel shard's experts are not read here
            gate, up = torch.mm(x, gate_up[local]).split(inter, dim=-1)  # [1, I] each
            out.addmm_(F.silu(gate).mul_(up), down[local], alpha=weight)
    return out


def run_experts_reference(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, gate_up: torch.Tensor,
                          down: torch.Tensor, expert_offset: int, num_experts: int) -> torch.Tensor:
    """`run_experts` as one GEMM pair per expert that got rows: the reference of the grouped path, and the path
    where torch._grouped_mm does not take the dtype."""
    num_local, _, inter2 = gate_up.shape
    inter = inter2 // 2
    groups = group_by_expert(expert_ids, num_experts)
    counts = groups.rows_per_expert.tolist()  # one host read per layer: the loop's bounds
    first_row = sum(counts[:expert_offset])
    local_counts = counts[expert_offset:expert_offset + num_local]
    num_rows = sum(local_counts)
    result = torch.zeros_like(x)
    if num_rows == 0:
        return result
    tokens = groups.token_of_row[first_row:first_row + num_rows]
    rows = x.index_select(0, tokens)  # [R, H]
    out = torch.empty_like(rows)
    start = 0
    for local, count in enumerate(local_counts):
        if count == 0:
            continue  # this expert's weights are never read
        end = start + count
        gate, up = torch.matmul(rows[start:end], gate_up[local]).split(inter, dim=-1)  # [c, I] each
        torch.matmul(F.silu(gate).mul_(up), down[local], out=out[start:end])
        start = end
    row_weights = weights.flatten().index_select(0, groups.order[first_row:first_row + num_rows])  # [R]
    out.mul_(row_weights.unsqueeze(1).to(out.dtype))
    return result.index_add_(0, tokens, out)


def is_grouped_mm_supported(x: torch.Tensor, gate_up: torch.Tensor) -> bool:
    """torch._grouped_mm runs on CPU (it skips groups without rows: an expert without tokens is never read) and, on
    CUDA, takes bf16 operands whose rows are whole 16-byte units."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if not x.is_cuda:
        return x.dtype in (torch.float32, torch.bfloat16)
    return x.dtype == torch.bfloat16 and x.shape[1] % 8 == 0 and gate_up.shape[2] % 16 == 0
