"""A model split into pipeline stages (a prefill group's members) computes what the whole model computes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncaked.engine.batch import PrefillSeq, build_prefill_batch, split_prefill_chunks
from mooncaked.engine.kv_pages import KVPages
from mooncaked.engine.runner import ModelRunner
from mooncaked.model.config import LayerRange, split_layers
from mooncaked.model.llama import LlamaForCausalLM
from mooncaked.model.memory_fit import weight_bytes
from mooncaked.model.presets import random_preset
from mooncaked.model.weight_names import CheckpointError, hf_tensor_shapes, random_hf_state_dict

BLOCK = 8


def _model(preset: str, layers: LayerRange | None = None, **overrides: object) -> LlamaForCausalLM:
    args = random_preset(preset, **overrides)
    model = LlamaForCausalLM(args, layers=layers)
    model.load_weights(random_hf_state_dict(args, seed=5).items())
    return model


def _runner(model: LlamaForCausalLM, num_pages: int) -> ModelRunner:
    pages = KVPages.for_model(model.args, num_pages=num_pages, block_size=BLOCK, dtype=torch.float32, device="cpu",
                              layers=model.layer_range)
    return ModelRunner(model, pages, backend="torch")


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("splits", [[], [1], [3], [1, 2]])
def test_stages_chained_chunk_by_chunk_equal_the_whole_model(tied: bool, splits: list[int]) -> None:
    args = random_preset("small", tie_word_embeddings=tied)
    stages = split_layers(args.num_layers, len(splits) + 1, splits)
    whole = _runner(_model("small", tie_word_embeddings=tied), 8)
    parts = [_runner(_model("small", layers, tie_word_embeddings=tied), 8) for layers in stages]
    tokens = [(13 * i + 5) % args.vocab_size for i in range(45)]
    seq = PrefillSeq(tokens, 0, list(range(6)))
    for chunk in split_prefill_chunks(seq, 16):
        batch = build_prefill_batch([chunk], block_size=BLOCK, num_pages=8, device="cpu")
        expected = whole.prefill(batch)
        hidden = None
        for part in parts[:-1]:
            hidden = part.prefill(batch, hidden_in=hidden, return_hidden=True)
        assert torch.equal(parts[-1].prefill(batch, hidden_in=hidden), expected)
    for part in parts:  # each stage's pages hold exactly the whole model's pages of its layers
        layers = part.model.layer_range
        assert torch.equal(part.kv_pages.buffer, whole.kv_pages.buffer[layers.start: layers.end])


def test_a_stage_holds_only_its_layers() -> None:
    args = random_preset("small", tie_word_embeddings=True)
    first, last = split_layers(args.num_layers, 2)
    head = LlamaForCausalLM(args, layers=first)
    tail = LlamaForCausalLM(args, layers=last)
    assert head.embed_tokens is not None and head.lm_head is None and head.norm is None
    assert tail.embed_tokens is None and tail.lm_head is not None
    assert [layer.layer_idx for layer in tail.layers] == [2, 3]
    assert "model.embed_tokens.weight" in hf_tensor_shapes(args, last)  # the tied head reads the embedding
    assert "model.layers.0.input_layernorm.weight" not in hf_tensor_shapes(args, last)
    whole = weight_bytes(args, torch.float32, "plain")
    embedding = args.vocab_size * args.hidden_size * 4
    # the head is a transposed copy of the embedding: the whole model holds both, the stages one each
    assert weight_bytes(args, torch.float32, "plain", first) + weight_bytes(args, torch.float32, "plain", last) \
        == whole + 2 * args.max_position_embeddings * args.head_dim * 4
    assert weight_bytes(args, torch.float32, "plain", last) < whole - embedding


def test_a_stage_still_checks_the_whole_checkpoint() -> None:
    args = random_preset("tiny")
    state = random_hf_state_dict(args, seed=1)
    del state["model.layers.1.mlp.up_proj.weight"]
    LlamaForCausalLM(args, layers=LayerRange(0, 1, 2)).load_weights(state.items())  # not its layer
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.up_proj.weight"):
        LlamaForCausalLM(args, layers=LayerRange(1, 2, 2)).load_weights(state.items())
    state["model.layers.7.mlp.up_proj.weight"] = torch.zeros(1)
    with pytest.raises(CheckpointError, match="not part of this model"):
        LlamaForCausalLM(args, layers=LayerRange(0, 1, 2)).load_weights(state.items())


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 200), st.integers(1, 12), st.lists(st.integers(-2, 210), max_size=11))
def test_layer_splits_cover_every_layer_once_or_are_refused(num_layers: int, num_stages: int,
                                                              splits: list[int]) -> None:
    try:
        stages = split_layers(num_layers, num_stages, splits)
    except ValueError as exc:
        assert str(exc)
        return
    assert [layer for stage in stages for layer in range(stage.start, stage.end)] == list(range(num_layers))
    assert len(stages) == num_stages and stages[0].has_embedding and stages[-1].has_head
    if not splits:
        sizes = [stage.size for stage in stages]
        assert max(sizes) - min(sizes) <= 1
