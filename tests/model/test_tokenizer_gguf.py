"""SentencePiece (llama) vocabularies in GGUF files (Llama 2, Mistral): the rebuilt tokenizer gives the ids
transformers' own GGUF tokenizer gives, and a llama-architecture GGUF with it serves end to end."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from mooncaked.model.loader import load_model
from mooncaked.model.tokenizer import TextTokenizer
from mooncaked.model.tokenizer_gguf import SPACE, sentencepiece_merges
from tests.model.family_checkpoints import (CASES, INST_TEMPLATE, add_sentencepiece_vocabulary, random_hf_model,
                                            write_gguf)

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CORPUS = [
    "the quick brown fox jumps over the lazy dog while the cat sleeps in the sun",
    "a tokenizer splits text into pieces; pieces that appear often become one token",
    "models read tokens, not letters: the vocabulary decides how long a prompt is",
    "Mistral and Llama 2 use sentencepiece with byte fallback for unseen characters",
] * 4
BYTES = [f"<0x{b:02X}>" for b in range(256)]


def _spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """A small SentencePiece-style BPE vocabulary trained on CORPUS: specials, byte tokens, then pieces by rank."""
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="always")
    trained.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=220, show_progress=False))
    pieces = [p for p, _ in sorted(trained.get_vocab().items(), key=lambda item: item[1])]
    tokens = ["<unk>", "<s>", "</s>", *BYTES, *pieces]
    scores = [0.0] * (3 + len(BYTES)) + [-float(rank) for rank in range(len(pieces))]
    types = [2, 3, 3] + [6] * len(BYTES) + [1] * len(pieces)
    return tokens, scores, types


def _write_spm_gguf(path: Path) -> None:
    """A vocabulary-only file (what the tokenizer tests read)."""
    tokens, scores, types = _spm_vocab()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    add_sentencepiece_vocabulary(writer, tokens, scores, types)
    writer.add_chat_template(INST_TEMPLATE)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def spm(tmp_path_factory: pytest.TempPathFactory) -> tuple[TextTokenizer, Any]:
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    _write_spm_gguf(path)
    from mooncaked.model.weights_gguf import GGUFModelFile

    ours = TextTokenizer.from_gguf_metadata(GGUFModelFile.open(path).metadata)
    theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return ours, theirs


_TEXT = st.text(st.sampled_from(sorted(set("".join(CORPUS)) - {"<", ">"}) + list("é東🤖\n\tQZ")), max_size=60)


@settings(max_examples=200, deadline=None)
@given(text=_TEXT.filter(lambda t: not t.startswith(" ")))
def test_sentencepiece_ids_match_transformers(spm: tuple[TextTokenizer, Any], text: str) -> None:
    """Text that does not start with a space: there transformers 5's Metaspace adds no second "▁" while llama.cpp
    (and Llama 2's own tokenizer.json) do; see the next test."""
    ours, theirs = spm
    assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
    assert ours.encode(text) == theirs.encode(text)  # BOS first, as add_bos_token says
    assert ours.decode(ours.encode(text)) == text


def test_unseen_characters_fall_back_to_bytes(spm: tuple[TextTokenizer, Any]) -> None:
    ours, _ = spm
    ids = ours.encode("東", add_special_tokens=False)
    pieces = [ours.backend.id_to_token(i) for i in ids]
    assert pieces == [SPACE, "<0xE6>", "<0x9D>", "<0xB1>"]  # 東 is E6 9D B1 in UTF-8


def test_space_prefix_like_llama_cpp(spm: tuple[TextTokenizer, Any]) -> None:
    """llama.cpp prefixes " " to every stretch of text that starts the input or follows a special token, even one
    that already starts with a space (transformers 5 only to the first stretch, and not before a space)."""
    ours, _ = spm
    space = ours.token_to_id(SPACE)
    after = ours.encode("</s>the", add_special_tokens=False)
    assert after[0] == 2 and after[1:] == ours.encode("the", add_special_tokens=False)
    assert ours.encode(" ", add_special_tokens=False) == [space, space]
    assert ours.encode("", add_special_tokens=False) == []


def test_merges_prefer_the_better_scored_piece() -> None:
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    merges = sentencepiece_merges(tokens, [0, 0, 0, -5.0, -1.0, -2.0], [1] * 6)
    assert merges.index(("b", "c")) < merges.index(("a", "b"))  # "bc" scores better than "ab"
    assert set(merges) == {("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc")}


def test_llama_architecture_gguf_with_a_sentencepiece_vocabulary_serves(tmp_path: Path) -> None:
    """A Mistral-style file: llama architecture, SentencePiece vocabulary, [INST] template."""
    tokens, scores, types = _spm_vocab()
    case = next(c for c in CASES if c.case_id == "llama2-mha")
    hf = random_hf_model(replace(case, config={**case.config, "vocab_size": len(tokens)}), seed=3)
    file = tmp_path / "mistral-style.gguf"
    write_gguf(hf, file, "llama", chat_template=INST_TEMPLATE, sentencepiece=(tokens, scores, types))
    loaded = load_model(str(file))
    prompt = loaded.chat_template.render([{"role": "user", "content": "the lazy cat"}])
    assert prompt == "<s>[INST] the lazy cat [/INST]"
    ids = loaded.tokenizer.encode(prompt, add_special_tokens=False)
    assert ids[0] == 1 and loaded.tokenizer.decode(ids) == "[INST] the lazy cat [/INST]"
