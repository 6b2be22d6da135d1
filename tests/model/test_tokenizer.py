"""SmolLM2 tokenizer and chat template built from the GGUF give transformers' token ids."""

from __future__ import annotations

from typing import Any

import pytest

from mooncaked.model.loader import LoadedModel
from mooncaked.model.tokenizer import byte_level_test_tokenizer

PROMPTS = [
    "What is the capital of France?",
    "Grüße aus Köln — naïve café, 東京タワー 🤖",
    "  leading spaces\n\ttabs, 12345 digits and 3.14159",
    "def f(x):\n    return x ** 2  # ünïcödé",
    "Привет, мир! ¿Qué tal? 😀👍🏽 <|im_end|> inside text",
]


def _hf_ids(result: Any) -> list[int]:
    ids = result["input_ids"] if not isinstance(result, list) else result
    return list(ids)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_chat_prompt_ids_match_transformers(smollm2: LoadedModel, hf_smollm2_tokenizer: Any, prompt: str) -> None:
    messages = [{"role": "user", "content": prompt}]
    expected = _hf_ids(hf_smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                tokenize=True))
    ours = smollm2.tokenizer.encode(smollm2.chat_template.render(messages), add_special_tokens=False)
    assert ours == expected
    assert smollm2.tokenizer.encode(prompt) == hf_smollm2_tokenizer.encode(prompt)
    assert smollm2.tokenizer.decode(ours, skip_special_tokens=False) == hf_smollm2_tokenizer.decode(expected)


def test_special_tokens_and_eos(smollm2: LoadedModel) -> None:
    tok = smollm2.tokenizer
    assert tok.bos_token == "<|im_start|>" and tok.eos_token == "<|im_end|>"
    assert smollm2.eos_token_ids == (2,)
    assert tok.encode("<|im_start|>user", add_special_tokens=False)[0] == 1
    assert tok.decode([1, 4093, 2]) == "user"  # specials skipped by default


def test_byte_level_test_tokenizer_round_trips_any_text() -> None:
    tok = byte_level_test_tokenizer()
    text = "héllo 東京 🤖<|im_end|>"
    ids = tok.encode(text)
    assert ids[-1] == 2 and max(ids) < tok.vocab_size
    assert tok.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("pre, expected", [
    ("qwen2", ["abc", "Ġ", "1", "2", "3", "4", "5"]),  # digits one at a time
    ("llama-bpe", ["abc", "Ġ", "123", "45"]),  # up to three digits
    ("default", ["abc", "Ġ12345"]),
])
def test_gguf_pre_tokenizers_split_digits_like_their_models(pre: str, expected: list[str]) -> None:
    from mooncaked.model.tokenizer_gguf import gguf_pre_tokenizer

    assert [piece for piece, _ in gguf_pre_tokenizer(pre).pre_tokenize_str("abc 12345")] == expected
