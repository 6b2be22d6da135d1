"""Model loading: the embedded SmolLM2 GGUF, Hugging Face directories, random presets, bad sources."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mooncaked.engine.batch import DecodeSeq, PrefillSeq, build_decode_batch, build_prefill_batch
from mooncaked.engine.kv_pages import KVPages
from mooncaked.engine.page_allocator import PageAllocator
from mooncaked.engine.runner import ModelRunner
from mooncaked.model.chat_template import CHATML_TEMPLATE
from mooncaked.model.frontend import ModelLoadError, load_frontend
from mooncaked.model.hf_config import to_hf_config
from mooncaked.model.loader import LoadedModel, load_model
from mooncaked.model.presets import random_preset
from mooncaked.model.tokenizer import byte_level_test_tokenizer
from mooncaked.model.weight_names import random_hf_state_dict
from mooncaked.runtime.errors import StartupError


def _greedy(loaded: LoadedModel, prompt_ids: list[int], num_tokens: int, block_size: int = 16) -> list[int]:
    num_pages = (len(prompt_ids) + num_tokens) // block_size + 1
    kv = KVPages.for_model(loaded.args, num_pages=num_pages, block_size=block_size, dtype=loaded.dtype,
                           device="cpu")
    runner = ModelRunner(loaded.model, kv)
    pages = PageAllocator(kv.num_pages).allocate(num_pages, "req")
    logits = runner.prefill(build_prefill_batch([PrefillSeq(prompt_ids, 0, pages)], block_size=block_size,
                                                num_pages=num_pages, device="cpu"))
    tokens = [int(logits[0].argmax())]
    while len(tokens) < num_tokens and tokens[-1] not in loaded.eos_token_ids:
        position = len(prompt_ids) + len(tokens) - 1
        batch = build_decode_batch([DecodeSeq(tokens[-1], position, pages)], block_size=block_size,
                                   num_pages=num_pages, device="cpu")
        tokens.append(int(runner.decode(batch)[0].argmax()))
    return tokens


def test_embedded_smollm2_answers_paris(smollm2: LoadedModel) -> None:
    assert smollm2.model_id == "smollm2-135m" and smollm2.context_length == 8192
    prompt = smollm2.chat_template.render([{"role": "user", "content": "What is the capital of France?"}])
    tokens = _greedy(smollm2, smollm2.tokenizer.encode(prompt, add_special_tokens=False), num_tokens=8)
    assert "Paris" in smollm2.tokenizer.decode(tokens)


def test_hf_checkpoint_directory_matches_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    args = random_preset("tiny")
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**to_hf_config(args))).eval()
    hf.load_state_dict(random_hf_state_dict(args, seed=7), strict=False)
    hf.save_pretrained(tmp_path)
    byte_level_test_tokenizer().backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHATML_TEMPLATE}))
    loaded = load_model(str(tmp_path))
    assert loaded.model_id == tmp_path.name and loaded.eos_token_ids == (2,)
    assert loaded.chat_template.render([{"role": "user", "content": "hi"}]).endswith("<|im_start|>assistant\n")
    prompt = loaded.tokenizer.encode("hello there", add_special_tokens=False)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0, -1]
    kv = KVPages.for_model(args, num_pages=4, block_size=8, dtype=torch.float32, device="cpu")
    batch = build_prefill_batch([PrefillSeq(prompt, 0, [0, 1])], block_size=8, num_pages=4, device="cpu")
    torch.testing.assert_close(ModelRunner(loaded.model, kv).prefill(batch)[0], expected, atol=1e-4, rtol=0)


def test_random_preset_is_seeded_and_cached() -> None:
    a = load_model("random:tiny", seed=1)
    assert load_model("random:tiny", seed=1) is a
    b = load_model("random:tiny", seed=2)
    assert not torch.equal(a.model.embed_tokens.weight, b.model.embed_tokens.weight)
    assert a.model_id == "random-tiny" and a.tokenizer.vocab_size <= a.args.vocab_size


@pytest.mark.parametrize("source, message", [
    ("random:nope", "unknown random model preset"),
    ("/no/such/model.bin", "is not"),
    ("/no/such/model.gguf", "does not exist"),
])
def test_bad_sources_raise_clear_errors(source: str, message: str) -> None:
    for load in (load_model, load_frontend):
        with pytest.raises(ModelLoadError, match=message) as raised:
            load(source)
        assert source in str(raised.value)


def test_an_unsupported_architecture_is_a_startup_error(tmp_path: Path) -> None:
    """What a restart cannot fix: a process that meets it exits 2 and is not restarted (lifecycle.py)."""
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}')
    for load in (load_model, load_frontend):
        with pytest.raises(StartupError, match=r"model_type 'gpt2' .* is not supported"):
            load(str(tmp_path))


def test_bad_dtype_is_named() -> None:
    with pytest.raises(ValueError, match="dtype 'int3'"):
        load_model("random:tiny", dtype="int3")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_half_precision_model_on_cpu_computes_its_logits_in_fp32(dtype: str) -> None:
    """keep_fp32_head: the output head is also held in fp32, so logits are not rounded to the model's dtype (in bf16
    near-equal logits tie and flip greedy choices)."""
    loaded = load_model("random:tiny", dtype=dtype, device="cpu")
    model = loaded.model
    assert model.head_fp32 is not None and model.lm_head is not None and model.lm_head.weight_t is not None
    assert model.head_fp32.dtype == torch.float32
    assert torch.equal(model.head_fp32, model.lm_head.weight_t.float())
    hidden = torch.randn(3, loaded.args.hidden_size, generator=torch.Generator().manual_seed(0)).to(loaded.dtype)
    assert model.norm is not None
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, model.norm(hidden).float() @ model.head_fp32)
    assert not torch.equal(logits, logits.to(loaded.dtype).float())  # finer than the model's dtype holds
    assert load_model("random:tiny", dtype="float32", device="cpu").model.head_fp32 is None
