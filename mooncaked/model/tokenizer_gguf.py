"""A `tokenizers.Tokenizer` rebuilt from a GGUF file's vocabulary, the way llama.cpp tokenizes with it.

1. `tokenizer.ggml.model` picks the kind: `gpt2` (byte-level BPE: Llama 3, Qwen, SmolLM) or `llama`
   (SentencePiece BPE with byte fallback: Llama 2, Mistral); others are refused by name.
2. gpt2: the vocabulary and merges as stored, the text split for the file's `tokenizer.ggml.pre`
   (`gguf_pre_tokenizer`), then the byte-level mapping.
3. llama: merges recovered from the vocabulary and its scores (a better-scored piece merges first, as
   llama.cpp's SentencePiece search does); spaces become "▁", and with `add_space_prefix` every stretch of
   text gets a leading "▁" — at the start and after each special token, as llama.cpp does; characters outside
   the vocabulary fall back to <0xXX> byte tokens.
4. Control tokens become special tokens and user-defined ones added tokens, so both stay whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4  # llama.cpp token types (2 unknown, 5 unused, 6 byte)
SPACE = "\u2581"  # SentencePiece's visible space

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


def gguf_tokenizer_backend(meta: Mapping[str, Any]) -> Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind not in ("gpt2", "llama"):
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported; only 'gpt2' (byte-level BPE) and "
                         "'llama' (SentencePiece BPE)")
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ValueError("GGUF tokenizer.ggml.tokens must be a list of strings")
    token_types = list(meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
    backend = _byte_level_bpe(meta, tokens) if kind == "gpt2" else _sentencepiece_bpe(meta, tokens, token_types)
    _add_typed_tokens(backend, tokens, token_types)
    return backend


def _byte_level_bpe(meta: Mapping[str, Any], tokens: list[str]) -> Tokenizer:
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False,
                                   byte_fallback=False))
    backend.pre_tokenizer = gguf_pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")))
    backend.decoder = decoders.ByteLevel()
    return backend


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


def _sentencepiece_bpe(meta: Mapping[str, Any], tokens: list[str], token_types: list[int]) -> Tokenizer:
    scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    if len(scores) != len(tokens) or len(token_types) != len(tokens):
        raise ValueError("GGUF tokenizer.ggml.scores and token_type must have one entry per token")
    unknown_id = meta.get("tokenizer.ggml.unknown_token_id")
    unknown = tokens[unknown_id] if isinstance(unknown_id, int) and 0 <= unknown_id < len(tokens) else None
    merges = sentencepiece_merges(tokens, scores, token_types)
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, unk_token=unknown,
                                   fuse_unk=True, byte_fallback=True))
    is_prefixed = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    # A normalizer (not Metaspace) so that every stretch between special tokens gets its prefix, like llama.cpp.
    steps = [normalizers.Prepend(SPACE)] if is_prefixed else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    strip = [decoders.Strip(content=" ", left=1, right=0)] if is_prefixed else []
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                         *strip])
    return backend


def sentencepiece_merges(tokens: list[str], scores: list[float], token_types: list[int]) -> list[tuple[str, str]]:
    """Every split of a normal piece into two normal pieces, best-scored merged piece first (ties: lower id,
    then the longer left part)."""
    normal = {t: i for i, (t, kind) in enumerate(zip(tokens, token_types)) if kind == _NORMAL}
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, piece_id in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-float(scores[piece_id]), piece_id, -len(left), left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


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
