"""Tensor-parallel shards: which heads, columns and experts each rank holds, the refusal of degrees that do not
divide the model, and a rank's shard read as slices from safetensors equals the same slice of the whole model."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncaked.model.families import args_from_hf_config
from mooncaked.model.llama import LlamaDecoderLayer
from mooncaked.model.loader import load_model, model_args
from mooncaked.model.memory_fit import weight_bytes
from mooncaked.model.presets import random_preset
from mooncaked.model.tensor_parallel import TensorParallelError, check_shardable, shard_shape
from tests.model.family_checkpoints import CASES, hf_config, write_checkpoint

pytest.importorskip("transformers")


@st.composite
def _head_counts(draw: st.DrawFn) -> tuple[int, int, int]:
    kv_heads = draw(st.integers(min_value=1, max_value=16))
    heads = kv_heads * draw(st.integers(min_value=1, max_value=8))
    return heads, kv_heads, draw(st.integers(min_value=1, max_value=16))


@settings(max_examples=300, deadline=None)
@given(counts=_head_counts(), intermediate=st.integers(min_value=1, max_value=96))
def test_shards_cover_every_head_once_and_pair_queries_with_their_kv_head(counts: tuple[int, int, int],
                                                                         intermediate: int) -> None:
    heads, kv_heads, num_ranks = counts
    args = random_preset("tiny", num_heads=heads, num_kv_heads=kv_heads, intermediate_size=intermediate)
    try:
        check_shardable(args, num_ranks)
    except TensorParallelError as exc:
        divides = heads % num_ranks == 0 and intermediate % num_ranks == 0 and (
            kv_heads % num_ranks == 0 if kv_heads >= num_ranks else num_ranks % kv_heads == 0)
        assert not divides and str(num_ranks) in str(exc)
        return
    shards = [shard_shape(args, rank, num_ranks) for rank in range(num_ranks)]
    assert sorted(h for s in shards for h in range(s.head_offset, s.head_offset + s.num_heads)) == list(range(heads))
    assert sorted(c for s in shards for c in range(s.intermediate_offset, s.intermediate_offset
                                                   + s.intermediate_size)) == list(range(intermediate))
    assert {s.kv_head_offset + k for s in shards for k in range(s.num_kv_heads)} == set(range(kv_heads))
    group = heads // kv_heads
    for s in shards:  # local query head j attends with local KV head j // (local group size), as the kernels do
        local_group = s.num_heads // s.num_kv_heads
        for j in range(s.num_heads):
            assert (s.head_offset + j) // group == s.kv_head_offset + j // local_group


def test_smollm2_heads_do_not_divide_by_two() -> None:
    with pytest.raises(TensorParallelError, match=r"tensor_parallel_size 2 .*9 query heads, 3 KV heads"):
        check_shardable(model_args("random:smollm2-135m"), 2)
    with pytest.raises(TensorParallelError, match="9 query heads, 3 KV heads"):
        load_model("random:smollm2-135m", shard=shard_shape(random_preset("tiny"), 0, 2))


def test_a_rank_reads_its_slices_of_the_checkpoint(tmp_path: Path) -> None:
    case = next(c for c in CASES if c.case_id == "llama-attention-and-mlp-bias")  # biases on every projection
    write_checkpoint(case, tmp_path, seed=3)
    whole = load_model(str(tmp_path), packing="plain")
    args = whole.args
    for rank in range(2):
        shard = shard_shape(args, rank, 2)
        loaded = load_model(str(tmp_path), packing="plain", shard=shard)
        assert loaded.model.weight_slices()
        layer, full = loaded.model.layers[1], whole.model.layers[1]
        assert isinstance(layer, LlamaDecoderLayer) and isinstance(full, LlamaDecoderLayer)
        d = args.head_dim
        q = slice(shard.head_offset * d, (shard.head_offset + shard.num_heads) * d)
        k = slice(args.q_size + shard.kv_head_offset * d, args.q_size + (shard.kv_head_offset + 1) * d)
        assert layer.qkv_proj.weight_t is not None and full.qkv_proj.weight_t is not None
        torch.testing.assert_close(layer.qkv_proj.weight_t[:, :shard.q_size], full.qkv_proj.weight_t[:, q])
        torch.testing.assert_close(layer.qkv_proj.weight_t[:, shard.q_size:shard.q_size + d],
                                   full.qkv_proj.weight_t[:, k])
        assert layer.o_proj.weight_t is not None and full.o_proj.weight_t is not None
        torch.testing.assert_close(layer.o_proj.weight_t, full.o_proj.weight_t[q])
        assert (layer.o_proj.bias is not None) == (rank == 0)  # row-parallel biases: added once, by rank 0
        assert (layer.down_proj.bias is not None) == (rank == 0) and layer.gate_up_proj.bias is not None
        head, full_head = loaded.model.lm_head, whole.model.lm_head  # split by vocabulary rows
        assert head is not None and full_head is not None and head.weight_t is not None
        assert full_head.weight_t is not None and shard.vocab_size == args.vocab_size // 2
        torch.testing.assert_close(head.weight_t, full_head.weight_t[:, rank * shard.vocab_size:
                                                                     (rank + 1) * shard.vocab_size])


def test_a_rank_needs_about_its_share_of_the_layers() -> None:
    args = random_preset("smollm2-135m", num_heads=8, num_kv_heads=4, head_dim=64)
    whole, rank = weight_bytes(args, torch.float32), weight_bytes(args, torch.float32, num_ranks=2)
    h, inter = args.hidden_size, args.intermediate_size
    per_layer = 2 * h * (args.q_size + args.kv_size) + 3 * h * inter  # q, k, v, o; gate, up, down
    head = args.vocab_size * h  # the tied head's transposed copy, split by vocabulary rows
    assert whole - rank == (args.num_layers * per_layer + head) * 4 // 2  # embedding and norms replicated


def test_each_rank_has_a_weight_file_of_its_own(tmp_path: Path) -> None:
    case = next(c for c in CASES if c.case_id == "qwen2.5-qkv-bias-tied")
    write_checkpoint(case, tmp_path / "ckpt", seed=4)
    args = model_args(str(tmp_path / "ckpt"))
    for rank in range(2):
        shard = shard_shape(args, rank, 2)
        mapped = load_model(str(tmp_path / "ckpt"), packing="plain", shard=shard, weight_cache_dir=tmp_path / "w")
        private = load_model(str(tmp_path / "ckpt"), packing="plain", shard=shard)
        for (name, a), (_, b) in zip(mapped.model.named_parameters(), private.model.named_parameters()):
            torch.testing.assert_close(a, b, msg=name)
    assert sorted(p.name.split("-")[-2] for p in (tmp_path / "w").glob("*.weights")) == ["tp0of2", "tp1of2"]


def test_an_expert_parallel_rank_reads_only_its_experts(tmp_path: Path) -> None:
    case = next(c for c in CASES if c.model_type == "qwen3_moe")  # 8 experts on layers 0 and 2
    write_checkpoint(case, tmp_path, seed=5)
    whole = load_model(str(tmp_path), packing="plain")
    args = whole.args
    assert args.moe is not None
    full = whole.model.layers[2]
    assert isinstance(full, LlamaDecoderLayer) and full.moe is not None
    for rank in range(2):
        shard = shard_shape(args, rank, 2, is_expert_parallel=True)
        loaded = load_model(str(tmp_path), packing="plain", shard=shard)
        slices = loaded.model.weight_slices()
        held = range(4 * rank, 4 * rank + 4)
        for e in range(8):
            name = f"model.layers.2.mlp.experts.{e}.down_proj.weight"
            # its own experts whole; another rank's an empty slice: none of their bytes are read
            assert slices[name] == ((1, 0, args.moe.intermediate_size) if e in held else (0, 0, 0)), name
        layer = loaded.model.layers[2]
        assert isinstance(layer, LlamaDecoderLayer) and layer.moe is not None
        torch.testing.assert_close(layer.moe.experts_down, full.moe.experts_down[held.start:held.stop])
        torch.testing.assert_close(layer.moe.router.weight_t, full.moe.router.weight_t)  # replicated


@pytest.mark.parametrize("overrides, num_ranks, is_expert_parallel, message", [
    ({"num_experts": 6}, 4, True, r"expert_parallel: tensor_parallel_size 4 does not divide the model's 6 routed "
                                  r"experts \(num_experts"),
    ({"moe_intermediate_size": 30}, 4, False, r"moe_intermediate_size 30"),
    ({}, 2, False, None),
    ({}, 2, True, None),
])
def test_experts_the_degree_does_not_divide_are_named(overrides: dict[str, Any], num_ranks: int,
                                                      is_expert_parallel: bool, message: str | None) -> None:
    case = next(c for c in CASES if c.model_type == "qwen3_moe")
    args = args_from_hf_config(hf_config(replace(case, config={**case.config, **overrides})).to_dict())
    if message is None:
        check_shardable(args, num_ranks, is_expert_parallel)
        return
    with pytest.raises(TensorParallelError, match=message):
        check_shardable(args, num_ranks, is_expert_parallel)


def test_expert_parallel_needs_experts() -> None:
    with pytest.raises(TensorParallelError, match="model.expert_parallel is set but the model has no experts"):
        check_shardable(random_preset("tiny"), 2, is_expert_parallel=True)
