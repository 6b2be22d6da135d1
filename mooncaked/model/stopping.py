"""When a generation ends, and which text a stream may show so far.

1. `GenerationState(tokenizer, params, prompt_ids, eos_token_ids)` is created per request on the instance
   that samples its tokens.
2. `append(token_id)` counts the token, detokenizes it, checks EOS / stop token ids / stop strings /
   max_tokens, and returns the text that is now safe to stream plus a finish reason when done. Before
   `min_tokens` output tokens nothing but max_tokens ends it (vLLM's rule; the sampler holds EOS and stop
   tokens back meanwhile).
3. Stop strings are matched on the decoded text, so a stop string spanning several tokens is found; text
   that could still turn into a stop string is held back until it cannot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mooncaked.model.detokenizer import IncrementalDetokenizer
from mooncaked.model.sampling_params import SamplingParams
from mooncaked.model.tokenizer import TextTokenizer

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


class StopStringMatcher:
    """Owned by one request: the decoded output text and how much of it was released to the stream."""

    def __init__(self, stop: Sequence[str], include_stop_str: bool = False) -> None:
        self.stop = tuple(stop)
        self.include_stop_str = include_stop_str
        self.text = ""
        self.num_released = 0
        self.matched: str | None = None

    def feed(self, delta: str, can_match: bool = True) -> str:
        """Append decoded text; return the newly releasable text (up to a stop string if one matched). A stop
        string matches only when it ends in `delta` and `can_match` (min_tokens reached)."""
        if self.matched is not None:
            return ""
        num_old = len(self.text)
        self.text += delta
        match = self._earliest_match(num_old) if can_match else None
        if match is not None:
            index, stop = match
            self.matched = stop
            self.text = self.text[: index + len(stop)] if self.include_stop_str else self.text[:index]
            return self._release(len(self.text))
        return self._release(len(self.text) - self._held_suffix_len())

    def flush(self) -> str:
        """At the end of generation: everything still held."""
        return self._release(len(self.text))

    def _earliest_match(self, num_old: int) -> tuple[int, str] | None:
        """The earliest stop string ending after the first `num_old` characters."""
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = self.text.find(stop, max(0, num_old - len(stop) + 1))
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _held_suffix_len(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stop:
            for length in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:length]):
                    longest = length
                    break
        return longest

    def _release(self, end: int) -> str:
        end = max(end, self.num_released)
        released = self.text[self.num_released:end]
        self.num_released = end
        return released


@dataclass(frozen=True)
class StepResult:
    text: str  # newly streamable text (may be empty)
    finish_reason: str | None  # FINISH_STOP, FINISH_LENGTH or None while running


class GenerationState:
    """Owned by the instance sampling one request: counts, detokenizer and stop matching for its output."""

    def __init__(self, tokenizer: TextTokenizer, params: SamplingParams, prompt_ids: Sequence[int] = (),
                 eos_token_ids: Sequence[int] = ()) -> None:
        self.params = params
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        self.matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self.stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(eos_token_ids))
        self.output_ids: list[int] = []
        self.finish_reason: str | None = None

    @property
    def text(self) -> str:
        """Output text released so far."""
        return self.matcher.text[: self.matcher.num_released]

    def append(self, token_id: int) -> StepResult:
        if self.finish_reason is not None:
            raise RuntimeError("append() after the generation finished")
        self.output_ids.append(token_id)
        can_stop = len(self.output_ids) >= self.params.min_tokens  # vLLM: no stop before min_tokens
        if token_id in self.stop_ids and can_stop:
            return self._finish(FINISH_STOP, self.matcher.feed(self.detokenizer.flush()))
        text = self.matcher.feed(self.detokenizer.add(token_id), can_match=can_stop)
        if self.matcher.matched is not None:
            return self._finish(FINISH_STOP, text)
        if len(self.output_ids) >= self.params.max_tokens:
            text += self.matcher.feed(self.detokenizer.flush())
            return self._finish(FINISH_STOP if self.matcher.matched else FINISH_LENGTH, text)
        return StepResult(text=text, finish_reason=None)

    def _finish(self, reason: str, text: str) -> StepResult:
        self.finish_reason = reason
        if self.matcher.matched is None:
            text += self.matcher.flush()
        return StepResult(text=text, finish_reason=reason)
