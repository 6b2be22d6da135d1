"""Megatron-style tensor parallelism: which heads and MLP columns each rank of N holds.

1. `check_shardable(args, num_ranks, is_expert_parallel)` refuses, at load, a model whose query heads, KV heads,
   MLP columns or experts the degree does not divide (TensorParallelError names the counts and the field). KV
   heads fewer than ranks are replicated: then the degree must be a multiple of the KV head count, so each
   rank's query heads share one KV head.
2. `shard_shape(args, rank, num_ranks, is_expert_parallel)`: rank r's ShardShape. Column-parallel projections
   (q/k/v, gate/up) take its output rows, row-parallel ones (o, down) its input columns; their partial outputs
   are summed across ranks with an all-reduce after o_proj and down_proj (model.llama), rank 0 adding the
   residual and the row-parallel biases once. The output head is split by vocabulary rows where the degree
   divides the vocabulary (each rank's logits are all-gathered), else replicated; embedding and norms are
   replicated. MoE layers: the router is replicated (every rank routes every token); the routed experts are
   column-sharded like the MLP (each rank a slice of every expert's columns) or, expert-parallel, partitioned
   (rank r holds experts r * E / N .. (r + 1) * E / N whole); shared experts are column-sharded. Either way a
   rank's output is a partial sum, added up by the MLP's all-reduce.
3. The model lists the part of each Hugging Face tensor a rank reads (`LlamaForCausalLM.weight_slices`), so a
   safetensors checkpoint is read slice by slice (model.weights_hf) rather than whole; `sliced_shape` is the
   shape such a slice has.
4. The process's group: the runner that joins one (engine.tp.rank) `install_group`s it; sharded layers
   `all_reduce` over it; `remove_group` when the runner stops. One group per process, owned by this module.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from mooncaked.model.config import ModelArgs, ShardShape
from mooncaked.runtime.errors import StartupError

# (dim, start, length) of a Hugging Face [out, in] tensor
Slice = tuple[int, int, int]


class TensorParallelError(StartupError, ValueError):
    """The model cannot be split across the configured ranks; the message names the counts."""


def check_shardable(args: ModelArgs, num_ranks: int, is_expert_parallel: bool = False) -> None:
    if num_ranks < 1:
        raise TensorParallelError(f"tensor_parallel_size must be >= 1, got {num_ranks}")
    heads, kv_heads, inter = args.num_heads, args.num_kv_heads, args.intermediate_size
    kv_ok = kv_heads % num_ranks == 0 if kv_heads >= num_ranks else num_ranks % kv_heads == 0
    if heads % num_ranks != 0 or not kv_ok:
        raise TensorParallelError(
            f"tensor_parallel_size {num_ranks} does not divide the model's attention heads ({heads} query heads, "
            f"{kv_heads} KV heads): each rank needs a whole number of query heads, and of KV heads (or, with "
            "fewer KV heads than ranks, a degree that is a multiple of them); choose a degree dividing both")
    if inter % num_ranks != 0:
        raise TensorParallelError(f"tensor_parallel_size {num_ranks} does not divide the model's MLP width "
                                  f"(intermediate_size {inter}); choose a degree that divides it")
    if args.moe is not None:
        _check_experts_shardable(args, num_ranks, is_expert_parallel)
    elif is_expert_parallel:
        raise TensorParallelError("model.expert_parallel is set but the model has no experts (a dense model); "
                                  "unset it")


def _check_experts_shardable(args: ModelArgs, num_ranks: int, is_expert_parallel: bool) -> None:
    moe = args.moe
    assert moe is not None
    if is_expert_parallel and moe.num_experts % num_ranks != 0:
        raise TensorParallelError(f"model.expert_parallel: tensor_parallel_size {num_ranks} does not divide the "
                                  f"model's {moe.num_experts} routed experts (num_experts / n_routed_experts): each "
                                  "rank holds an equal number of whole experts; choose a degree dividing it, or "
                                  "column-shard the experts (expert_parallel: false)")
    if not is_expert_parallel and moe.intermediate_size % num_ranks != 0:
        raise TensorParallelError(f"tensor_parallel_size {num_ranks} does not divide the experts' MLP width "
                                  f"(moe_intermediate_size {moe.intermediate_size}); choose a degree that divides "
                                  "it, or partition whole experts across the ranks (model.expert_parallel: true)")
    if moe.shared_intermediate_size % num_ranks != 0:
        raise TensorParallelError(f"tensor_parallel_size {num_ranks} does not divide the shared experts' MLP width "
                                  f"(n_shared_experts x moe_intermediate_size = {moe.shared_intermediate_size})")


def shard_shape(args: ModelArgs, rank: int, num_ranks: int, is_expert_parallel: bool = False) -> ShardShape:
    """Rank `rank`'s heads, MLP columns and experts (the whole layer at num_ranks 1)."""
    check_shardable(args, num_ranks, is_expert_parallel)
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank {rank} is not in [0, {num_ranks})")
    num_heads = args.num_heads // num_ranks
    inter = args.intermediate_size // num_ranks
    if args.num_kv_heads >= num_ranks:
        num_kv_heads = args.num_kv_heads // num_ranks
        kv_head_offset = rank * num_kv_heads
    else:  # replicated: ranks_per_kv_head consecutive ranks hold the same KV head
        num_kv_heads = 1
        kv_head_offset = rank // (num_ranks // args.num_kv_heads)
    vocab = args.vocab_size // num_ranks if num_ranks > 1 and args.vocab_size % num_ranks == 0 else None
    shape = ShardShape(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=args.head_dim,
                       intermediate_size=inter, head_offset=rank * num_heads, kv_head_offset=kv_head_offset,
                       intermediate_offset=rank * inter, rank=rank, num_ranks=num_ranks, vocab_size=vocab,
                       vocab_offset=0 if vocab is None else rank * vocab)
    return shape if args.moe is None else _with_experts(shape, args, is_expert_parallel)


def _with_experts(shape: ShardShape, args: ModelArgs, is_expert_parallel: bool) -> ShardShape:
    moe = args.moe
    assert moe is not None
    rank, num_ranks = shape.rank, shape.num_ranks
    shared = moe.shared_intermediate_size // num_ranks
    if is_expert_parallel:
        num_experts = moe.num_experts // num_ranks
        experts = {"num_experts": num_experts, "expert_offset": rank * num_experts,
                   "expert_intermediate_size": moe.intermediate_size}
    else:
        inter = moe.intermediate_size // num_ranks
        experts = {"num_experts": moe.num_experts, "expert_intermediate_size": inter,
                   "expert_intermediate_offset": rank * inter}
    return dataclasses.replace(shape, **experts, shared_intermediate_size=shared,
                               shared_intermediate_offset=rank * shared, is_expert_parallel=is_expert_parallel)


def rank_kv_args(args: ModelArgs, num_ranks: int) -> ModelArgs:
    """`args` with one rank's KV head count: what sizing a rank's KV pages counts per page."""
    return dataclasses.replace(args, num_kv_heads=shard_shape(args, 0, num_ranks).num_kv_heads)


def sliced_shape(shape: tuple[int, ...], piece: Slice | None) -> tuple[int, ...]:
    if piece is None:
        return shape
    dim, _, length = piece
    return shape[:dim] + (length,) + shape[dim + 1:]


class Reducer(Protocol):
    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` in place across the ranks."""

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's 2-D `tensor` [R, C], side by side in rank order: [R, C * num_ranks]."""


_group: Reducer | None = None  # how this process's rank all-reduces with the others (engine.tp.rank), or None


def install_group(group: Reducer) -> None:
    global _group
    if _group is not None:
        raise RuntimeError("this process already belongs to a tensor-parallel group; stop its runner first")
    _group = group


def remove_group() -> None:
    global _group
    _group = None


def has_group() -> bool:
    return _group is not None


def all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """[R, C] on each rank -> [R, C * num_ranks] (the output head's logits, split by vocabulary rows)."""
    if _group is None:
        raise RuntimeError("a tensor-parallel shard runs only in a process that joined its group (engine.tp.runner)")
    return _group.all_gather(tensor)


def all_reduce(tensor: torch.Tensor) -> None:
    """Sum `tensor` in place across the ranks; raises (the backend's error) when a rank is gone or the group's
    timeout passes."""
    if _group is None:
        raise RuntimeError("a tensor-parallel shard runs only in a process that joined its group (engine.tp.runner)")
    _group.all_reduce(tensor)
