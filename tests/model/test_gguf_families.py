"""GGUF files of the llama (with Llama 3.1 rope_freqs), qwen2 and qwen3 architectures, laid out as llama.cpp's
converter writes them: they load and match the transformers model they were written from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mooncaked.engine.batch import DecodeSeq, PrefillSeq, build_decode_batch, build_prefill_batch
from mooncaked.engine.kv_pages import KVPages
from mooncaked.engine.page_allocator import PageAllocator
from mooncaked.engine.runner import ModelRunner
from mooncaked.model.rope_scaling import Llama3Scaling
from mooncaked.model.families import UnsupportedModel
from mooncaked.model.frontend import load_frontend
from mooncaked.model.loader import LoadedModel, load_model
from mooncaked.model.rope import inverse_frequencies
from tests.model.family_checkpoints import CASES, CHATML_TOOLS_TEMPLATE, random_hf_model, write_gguf

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

BLOCK = 8
GGUF_CASES = {"llama3.1-untied-rope-llama3": "llama", "llama2-mha": "llama", "qwen2.5-qkv-bias-tied": "qwen2",
              "qwen3-qk-norm-tied": "qwen3"}


def _llama3_rope_freqs(config: Any) -> np.ndarray:
    """What llama.cpp's converter stores for rope_type llama3: per-frequency divisors of the base frequencies."""
    rope = config.rope_parameters
    head_dim = config.hidden_size // config.num_attention_heads
    scaling = Llama3Scaling(rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
                          rope["original_max_position_embeddings"])
    theta = float(rope["rope_theta"])
    return (inverse_frequencies(head_dim, theta, None) / inverse_frequencies(head_dim, theta, scaling)).numpy()


def _write(case_id: str, path: Path) -> tuple[Any, Path]:
    case = next(c for c in CASES if c.case_id == case_id)
    hf = random_hf_model(case, seed=21)
    rope = hf.config.rope_parameters
    rope_freqs = _llama3_rope_freqs(hf.config) if rope.get("rope_type") == "llama3" else None
    file = path / f"{case_id}.gguf"
    write_gguf(hf, file, GGUF_CASES[case_id], rope_freqs, chat_template=CHATML_TOOLS_TEMPLATE)
    return hf, file


def _all_logits(loaded: LoadedModel, tokens: list[int], prompt_len: int) -> torch.Tensor:
    kv = KVPages.for_model(loaded.args, num_pages=8, block_size=BLOCK, dtype=torch.float32, device="cpu")
    runner = ModelRunner(loaded.model, kv, backend="torch")
    pages = PageAllocator(kv.num_pages).allocate(8, "r")
    logits = [runner.prefill(build_prefill_batch([PrefillSeq(tokens[:prompt_len], 0, pages)], block_size=BLOCK,
                                                 num_pages=8, device="cpu"), return_all_logits=True)]
    for position in range(prompt_len, len(tokens)):
        batch = build_decode_batch([DecodeSeq(tokens[position], position, pages)], block_size=BLOCK, num_pages=8,
                                   device="cpu")
        logits.append(runner.decode(batch))
    return torch.cat(logits)


@pytest.mark.parametrize("case_id", list(GGUF_CASES))
def test_gguf_matches_the_transformers_model(case_id: str, tmp_path: Path) -> None:
    hf, file = _write(case_id, tmp_path)
    loaded = load_model(str(file))
    assert loaded.args.family == GGUF_CASES[case_id] or (case_id.startswith("llama") and loaded.args.family == "llama")
    assert loaded.args.tie_word_embeddings == hf.config.tie_word_embeddings
    assert (loaded.args.rope_freq_factors is not None) == (case_id == "llama3.1-untied-rope-llama3")
    tokens = [3 + (7 * i) % 250 for i in range(27)]
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(_all_logits(loaded, tokens, prompt_len=21), expected, atol=1e-4, rtol=0)
    frontend = load_frontend(str(file))
    assert frontend.args == loaded.args and frontend.chat_template.source == CHATML_TOOLS_TEMPLATE
    assert frontend.tokenizer.encode("hi", add_special_tokens=False) == [3 + ord("h") - 33, 3 + ord("i") - 33]


@pytest.mark.parametrize("case_id", ["llama2-mha", "qwen2.5-qkv-bias-tied"])
def test_transformers_reads_our_gguf_layout_alike(case_id: str, tmp_path: Path) -> None:
    """transformers' own GGUF reader (llama: rows un-permuted; qwen2: as stored) gives the source model back:
    the files these tests write follow the converter's layout, not one only our reader understands."""
    hf, file = _write(case_id, tmp_path)
    reread = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=file.name).eval()
    tokens = torch.tensor([[3 + (5 * i) % 250 for i in range(17)]])
    with torch.no_grad():
        torch.testing.assert_close(reread(tokens).logits, hf(tokens).logits, atol=1e-5, rtol=0)


def test_unsupported_gguf_architecture_is_named(tmp_path: Path) -> None:
    file = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(file), "gemma2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModel, match="GGUF architecture 'gemma2' is not supported"):
        load_model(str(file))
