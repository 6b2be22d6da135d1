"""Incremental detokenization for streaming: text deltas that never split a multi-byte character.

1. Start with the last few prompt tokens as context (so a leading space or word piece decodes as it would
   inside the full text), the way vLLM does.
2. `add(token_id)` decodes a short window before and after the new token; the difference is the new text.
   A window ending in U+FFFD is an incomplete UTF-8 sequence (byte-level BPE splits characters across
   tokens): the text is held back until the following tokens complete it.
3. `flush()` at the end returns whatever is still held (possibly with U+FFFD if generation cut a character).
"""

from __future__ import annotations

from collections.abc import Sequence

from mooncaked.model.tokenizer import TextTokenizer

_CONTEXT_TOKENS = 6
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Owned by one request's output stream; not thread-safe."""

    def __init__(self, tokenizer: TextTokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # window start for decoding
        self._read_offset = len(self._ids)  # tokens before this are already emitted as text
        self.text = ""  # everything emitted so far

    def add(self, token_id: int) -> str:
        """Append one generated token; returns the newly complete text (possibly empty)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            return ""
        delta = full_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._trim()
        self.text += delta
        return delta

    def flush(self) -> str:
        """Text still held back (an incomplete character at the end of generation)."""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        delta = full_text[len(prefix_text):] if len(full_text) > len(prefix_text) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def _trim(self) -> None:
        """Drop ids before the decode window so memory stays bounded on long generations."""
        if self._prefix_offset > 4 * _CONTEXT_TOKENS:
            drop = self._prefix_offset
            del self._ids[:drop]
            self._prefix_offset -= drop
            self._read_offset -= drop
