"""A tiny random Llama through our runner gives transformers' LlamaForCausalLM logits (fp32, 1e-4)."""

from __future__ import annotations

import pytest
import torch

from mooncaked.engine.batch import DecodeSeq, PrefillSeq, build_decode_batch, build_prefill_batch
from mooncaked.engine.kv_pages import KVPages
from mooncaked.engine.page_allocator import PageAllocator
from mooncaked.engine.runner import ModelRunner
from mooncaked.model import packed_gemm
from mooncaked.model.hf_config import to_hf_config
from mooncaked.model.presets import random_preset
from mooncaked.model.rope_scaling import Llama3Scaling
from mooncaked.model.llama import LlamaForCausalLM
from mooncaked.model.weight_names import random_hf_state_dict

transformers = pytest.importorskip("transformers")

BLOCK = 8


def _pair(**overrides: object) -> tuple[LlamaForCausalLM, torch.nn.Module]:
    args = random_preset("tiny", **overrides)
    state = random_hf_state_dict(args, seed=3)
    ours = LlamaForCausalLM(args)
    ours.load_hf_state_dict(state)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**to_hf_config(args))).eval()
    hf.load_state_dict(state, strict=False)
    return ours, hf


@pytest.mark.parametrize("overrides", [
    {},
    {"tie_word_embeddings": True, "num_kv_heads": 1, "rope_theta": 500000.0,
     "rope_scaling": Llama3Scaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=16)},
], ids=["gqa2-untied", "mqa-tied-llama3-rope"])
@pytest.mark.parametrize("is_packed", [False, True], ids=["plain-gemm", "mkl-packed-gemm"])
def test_prefill_and_decode_match_transformers(overrides: dict[str, object], is_packed: bool) -> None:
    ours, hf = _pair(**overrides)
    if is_packed:
        if not packed_gemm.is_available():
            pytest.skip("this torch build has no MKL packed GEMM")
        assert ours.pack_for_cpu() == 1 + 4 * ours.args.num_layers  # lm_head + 4 projections per layer
    kv = KVPages.for_model(ours.args, num_pages=8, block_size=BLOCK, dtype=torch.float32, device="cpu")
    runner = ModelRunner(ours, kv, backend="torch")
    prompt = list(range(5, 26))  # 21 tokens: not a multiple of the block size
    pages = PageAllocator(kv.num_pages).allocate(4, "req")
    prefill = build_prefill_batch([PrefillSeq(prompt, 0, pages)], block_size=BLOCK, num_pages=8, device="cpu")
    logits = [runner.prefill(prefill, return_all_logits=True)]
    tokens = list(prompt)
    for _ in range(8):
        tokens.append(int(logits[-1][-1].argmax()))
        batch = build_decode_batch([DecodeSeq(tokens[-1], len(tokens) - 1, pages)], block_size=BLOCK,
                                   num_pages=8, device="cpu")
        logits.append(runner.decode(batch))
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0]  # [len(tokens), vocab]
    ours_all = torch.cat(logits)  # rows: every prompt position, then one per decode step
    assert ours_all.shape == (len(tokens), ours.args.vocab_size)
    torch.testing.assert_close(ours_all, expected, atol=1e-4, rtol=0)


def test_checkpoint_shape_mismatch_names_tensor() -> None:
    args = random_preset("tiny")
    state = random_hf_state_dict(args, seed=0)
    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        LlamaForCausalLM(args).load_hf_state_dict(state)


def test_missing_tensor_is_named() -> None:
    args = random_preset("tiny")
    state = random_hf_state_dict(args, seed=0)
    del state["model.norm.weight"]
    with pytest.raises(ValueError, match="model.norm.weight"):
        LlamaForCausalLM(args).load_hf_state_dict(state)
