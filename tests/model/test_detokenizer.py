"""Incremental detokenization never emits half a multi-byte character."""

from __future__ import annotations

from mooncaked.model.detokenizer import IncrementalDetokenizer
from mooncaked.model.tokenizer import byte_level_test_tokenizer


def test_multibyte_characters_are_held_until_complete() -> None:
    tok = byte_level_test_tokenizer()  # one token per byte: every non-ASCII character spans tokens
    text = "aé東🤖b"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[:3] == ["a", "", "é"]  # é is two bytes: nothing after the first
    assert detok.text == text


def test_prompt_context_and_special_tokens() -> None:
    tok = byte_level_test_tokenizer()
    prompt = tok.encode("<|im_start|>user\nhey")
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    out = "".join(detok.add(i) for i in tok.encode(" you<|im_end|>"))
    assert out == " you"


def test_flush_returns_an_incomplete_tail() -> None:
    tok = byte_level_test_tokenizer()
    detok = IncrementalDetokenizer(tok)
    ids = tok.encode("x🤖")
    assert detok.add(ids[0]) == "x"
    assert [detok.add(i) for i in ids[1:3]] == ["", ""]
    assert detok.flush() == "\ufffd"


def test_long_generation_keeps_memory_bounded() -> None:
    tok = byte_level_test_tokenizer()
    detok = IncrementalDetokenizer(tok)
    for i in tok.encode("abc" * 200):
        detok.add(i)
    assert detok.text == "abc" * 200
    assert len(detok._ids) < 40
