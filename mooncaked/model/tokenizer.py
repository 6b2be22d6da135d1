"""Text <-> token ids, backed by a `tokenizers.Tokenizer`.

1. Build: `TextTokenizer.from_hf_dir` (tokenizer.json + tokenizer_config.json), `from_gguf_metadata`
   (gpt2-style byte-level BPE rebuilt from the GGUF vocabulary, merges and token types, the way llama.cpp
   splits text for the file's `tokenizer.ggml.pre`), or `byte_level_test_tokenizer` (random test models).
2. `encode(text, add_special_tokens)`: special tokens written in the text (`<|im_start|>`) stay whole.
3. `decode(ids)`; streaming goes through `detokenizer.IncrementalDetokenizer`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

_CONTROL = 3  # llama.cpp token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
_USER_DEFINED = 4

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2's split: Llama 3's, but digits one at a time.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp pre-tokenizer names that first cut digits one by one, then apply the GPT-2 regex.
_DIGIT_SPLIT_PRES = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"}
_LLAMA3_PRES = {"llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"}
_QWEN2_PRES = {"qwen2", "deepseek-r1-qwen"}


class TextTokenizer:
    """Immutable after construction; safe to share between requests."""

    def __init__(self, backend: Tokenizer, *, bos_token_id: int | None, eos_token_ids: Sequence[int],
                 prepend_bos: bool, bos_token: str | None = None, eos_token: str | None = None) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.prepend_bos = prepend_bos  # set for GGUF files, where no post-processor adds BOS
        self.bos_token = bos_token if bos_token is not None else self._token_or_none(bos_token_id)
        eos_default = self.eos_token_ids[0] if self.eos_token_ids else None
        self.eos_token = eos_token if eos_token is not None else self._token_or_none(eos_default)

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.prepend_bos and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        token_id = self.backend.token_to_id(token)
        return None if token_id is None else int(token_id)

    def _token_or_none(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)

    @classmethod
    def from_hf_dir(cls, model_dir: Path, eos_token_ids: Sequence[int] = ()) -> TextTokenizer:
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
        backend = Tokenizer.from_file(str(path))
        config = read_tokenizer_config(model_dir)
        bos = _special_token_text(config.get("bos_token"))
        eos = _special_token_text(config.get("eos_token"))
        bos_id = backend.token_to_id(bos) if bos else None
        eos_ids = list(eos_token_ids)
        eos_id = backend.token_to_id(eos) if eos else None
        if eos_id is not None and eos_id not in eos_ids:
            eos_ids.insert(0, eos_id)
        return cls(backend, bos_token_id=bos_id, eos_token_ids=eos_ids, prepend_bos=False,
                   bos_token=bos, eos_token=eos)

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> TextTokenizer:
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"GGUF tokenizer model {model!r} is not supported; only 'gpt2' (byte-level BPE)")
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                       fuse_unk=False, byte_fallback=False))
        backend.pre_tokenizer = gguf_pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")))
        backend.decoder = decoders.ByteLevel()
        token_types = list(meta.get("tokenizer.ggml.token_type", []))
        _add_typed_tokens(backend, tokens, token_types)
        bos = meta.get("tokenizer.ggml.bos_token_id")
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(backend, bos_token_id=None if bos is None else int(bos),
                   eos_token_ids=() if eos is None else (int(eos),),
                   prepend_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)))


def gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The text split llama.cpp applies for `tokenizer.ggml.pre`, followed by the byte-level mapping."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    if pre in _LLAMA3_PRES or pre in _QWEN2_PRES:
        pattern = _LLAMA3_SPLIT if pre in _LLAMA3_PRES else _QWEN2_SPLIT
        split = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
        return pre_tokenizers.Sequence([split, byte_level])
    gpt2 = pre_tokenizers.Split(Regex(_GPT2_SPLIT), behavior="isolated")
    if pre in _DIGIT_SPLIT_PRES:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2, byte_level])
    return pre_tokenizers.Sequence([gpt2, byte_level])


def _add_typed_tokens(backend: Tokenizer, tokens: list[str], token_types: list[int]) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens (kept whole)."""
    special = [AddedToken(t, special=True, normalized=False)
               for t, kind in zip(tokens, token_types) if kind == _CONTROL]
    user = [AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, token_types) if kind == _USER_DEFINED]
    if special:
        backend.add_special_tokens(special)
    if user:
        backend.add_tokens(user)


def read_tokenizer_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "tokenizer_config.json"
    if not path.is_file():
        return {}
    config: dict[str, Any] = json.loads(path.read_text())
    return config


def _special_token_text(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or an AddedToken dict."""
    if isinstance(value, dict):
        content = value.get("content")
        return None if content is None else str(content)
    return None if value is None else str(value)


TEST_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def byte_level_test_tokenizer() -> TextTokenizer:
    """Byte-level tokenizer without merges for random test models: ids 0-2 are TEST_SPECIAL_TOKENS
    (bos = <|im_start|>, eos = <|im_end|>), ids 3..258 the 256 bytes."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate(TEST_SPECIAL_TOKENS)}
    vocab.update({ch: len(TEST_SPECIAL_TOKENS) + i for i, ch in enumerate(alphabet)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TEST_SPECIAL_TOKENS])
    return TextTokenizer(backend, bos_token_id=1, eos_token_ids=(2,), prepend_bos=False)
