"""Text <-> token ids, backed by a `tokenizers.Tokenizer`.

1. Build: `TextTokenizer.from_hf_dir` (tokenizer.json + tokenizer_config.json), `from_gguf_metadata`
   (rebuilt from the GGUF vocabulary by model.tokenizer_gguf), or `byte_level_test_tokenizer` (random test
   models).
2. `encode(text, add_special_tokens)`: special tokens written in the text (`<|im_start|>`) stay whole. It
   releases the GIL while it encodes, so a long text encoded on another thread leaves the event loop free.
   `max_token_chars` (the longest token of the vocabulary) bounds the text a number of tokens can hold.
3. `decode(ids)`; streaming goes through `detokenizer.IncrementalDetokenizer`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from mooncaked.model.tokenizer_gguf import gguf_tokenizer_backend

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
        # a vocabulary entry is at least as long as the text its token stands for (byte-level: one character
        # per byte; byte-fallback entries like <0x41>: longer)
        self.max_token_chars = max((len(token) for token in backend.get_vocab(with_added_tokens=True)), default=1)

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch, not encode: only it releases the GIL
        ids: list[int] = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
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
        """Byte-level BPE or SentencePiece BPE, as model.tokenizer_gguf rebuilds them from the vocabulary."""
        backend = gguf_tokenizer_backend(meta)
        bos = meta.get("tokenizer.ggml.bos_token_id")
        eos = meta.get("tokenizer.ggml.eos_token_id")
        # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
        add_bos = meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama")
        return cls(backend, bos_token_id=None if bos is None else int(bos),
                   eos_token_ids=() if eos is None else (int(eos),), prepend_bos=bool(add_bos))


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
