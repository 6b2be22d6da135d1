"""Where each Hugging Face tensor of a decoder layer lands in the fused, transposed parameters of one shard.

1. `attention_targets(prefix, shape, qkv, o_proj)` and `mlp_targets(prefix, shape, gate_up, down)`: name ->
   WeightTarget for one layer's GQA attention and dense MLP (model.moe and model.mla map theirs). Column-parallel
   projections (q/k/v, gate/up) take the shard's output rows of the [out, in] tensor, row-parallel ones (o,
   down) its input columns; at TP=1 the slices are whole. Row-parallel biases live on rank 0 only (the
   all-reduce sums the ranks' outputs, so each is added once).
2. `WeightTarget.copy_from(tensor, is_sliced)` narrows a whole tensor to the shard's slice (or takes a tensor
   the reader already sliced), transposes it where needed, and copies it in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from mooncaked.model.config import ShardShape
from mooncaked.model.layers import Linear


@dataclass(frozen=True)
class WeightTarget:
    """Where one checkpoint tensor lands: `dst`, a view of a (fused) parameter, from the source's
    `narrow` = (dim, start, length) slice in Hugging Face layout, transposed for [in, out] projections."""

    dst: torch.Tensor
    is_transposed: bool = False
    narrow: tuple[int, int, int] | None = None

    def copy_from(self, tensor: torch.Tensor, is_sliced: bool = False) -> None:
        """`is_sliced`: `tensor` is already this target's slice (read so from the checkpoint)."""
        src = tensor if self.narrow is None or is_sliced else tensor.narrow(*self.narrow)
        src = src.t() if self.is_transposed else src
        assert tuple(src.shape) == tuple(self.dst.shape), (tuple(src.shape), tuple(self.dst.shape))
        self.dst.copy_(src)


def attention_targets(p: str, s: ShardShape, qkv: Linear, o_proj: Linear) -> dict[str, WeightTarget]:
    """Targets of a GQA layer's attention tensors (names `p` + ...): q/k/v rows into the fused qkv projection,
    o_proj's input columns, their biases."""
    q_end, k_end = s.q_size, s.q_size + s.kv_size
    q_rows, kv_rows = (s.head_offset * s.head_dim, s.q_size), (s.kv_head_offset * s.head_dim, s.kv_size)
    targets = {
        p + "self_attn.q_proj.weight": WeightTarget(plain(qkv)[:, :q_end], True, (0, *q_rows)),
        p + "self_attn.k_proj.weight": WeightTarget(plain(qkv)[:, q_end:k_end], True, (0, *kv_rows)),
        p + "self_attn.v_proj.weight": WeightTarget(plain(qkv)[:, k_end:], True, (0, *kv_rows)),
        p + "self_attn.o_proj.weight": WeightTarget(plain(o_proj), True, (1, *q_rows)),
    }
    if qkv.bias is not None:
        targets[p + "self_attn.q_proj.bias"] = WeightTarget(qkv.bias[:q_end], narrow=(0, *q_rows))
        targets[p + "self_attn.k_proj.bias"] = WeightTarget(qkv.bias[q_end:k_end], narrow=(0, *kv_rows))
        targets[p + "self_attn.v_proj.bias"] = WeightTarget(qkv.bias[k_end:], narrow=(0, *kv_rows))
    if o_proj.bias is not None:  # row-parallel biases: rank 0 only
        targets[p + "self_attn.o_proj.bias"] = WeightTarget(o_proj.bias)
    return targets


def mlp_targets(p: str, s: ShardShape, gate_up: Linear, down_proj: Linear) -> dict[str, WeightTarget]:
    """Targets of a dense MLP's tensors: gate/up rows into the fused projection, down_proj's input columns."""
    inter = s.intermediate_size
    inter_rows = (s.intermediate_offset, inter)
    targets = {
        p + "mlp.gate_proj.weight": WeightTarget(plain(gate_up)[:, :inter], True, (0, *inter_rows)),
        p + "mlp.up_proj.weight": WeightTarget(plain(gate_up)[:, inter:], True, (0, *inter_rows)),
        p + "mlp.down_proj.weight": WeightTarget(plain(down_proj), True, (1, *inter_rows)),
    }
    if gate_up.bias is not None:
        targets[p + "mlp.gate_proj.bias"] = WeightTarget(gate_up.bias[:inter], narrow=(0, *inter_rows))
        targets[p + "mlp.up_proj.bias"] = WeightTarget(gate_up.bias[inter:], narrow=(0, *inter_rows))
    if down_proj.bias is not None:  # row-parallel: rank 0 only
        targets[p + "mlp.down_proj.bias"] = WeightTarget(down_proj.bias)
    return targets


def plain(linear: Linear) -> torch.Tensor:
    if linear.weight_t is None:
        raise RuntimeError("weights cannot be loaded into a projection whose plain weight was replaced by its "
                           "packed copy; load a new model")
    return linear.weight_t
