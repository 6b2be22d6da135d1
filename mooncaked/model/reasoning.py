"""Models that think before they answer: the reasoning block of an output, told apart from the answer
(docs/api.md#reasoning).

1. `reasoning_format_for(template_source)` says whether the model thinks: its chat template writes a `<think>` block
   (Qwen3, DeepSeek-R1, Kimi K2 Thinking, QwQ); None for the others.
2. `reasoning_mode(prompt_tail, format)` reads the end of a rendered prompt: INSIDE when the template already opened
   the block (DeepSeek-R1's generation prompt), CLOSED when it wrote an empty one (Qwen3 with enable_thinking
   false), OPTIONAL when the model opens one itself or not (Qwen3 by default).
3. `ReasoningParser(format, mode)` splits the streamed output text: `feed(text)` returns (reasoning, answer) deltas,
   holding back a suffix that could still turn into a marker; `finish()` the rest. An output that never closes its
   block is reasoning to its end.
4. `reasoning_lark(format, mode, token_ids)` is the grammar prefix that lets the reasoning run free before a
   constrained answer (model/grammar.py `after_prefix` composes it), so JSON and tool-call constraints apply to the
   answer only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from mooncaked.model.tool_parser import marker_prefix_len

INSIDE, OPTIONAL, CLOSED = "inside", "optional", "closed"


@dataclass(frozen=True)
class ReasoningFormat:
    start: str = "<think>"
    end: str = "</think>"


THINK = ReasoningFormat()


def reasoning_format_for(template_source: str) -> ReasoningFormat | None:
    return THINK if THINK.start in template_source and THINK.end in template_source else None


def reasoning_mode(prompt_tail: str, fmt: ReasoningFormat) -> str:
    opened, closed = prompt_tail.rfind(fmt.start), prompt_tail.rfind(fmt.end)
    if opened > closed:
        return INSIDE
    if closed >= 0 and not prompt_tail[closed + len(fmt.end):].strip():
        return CLOSED
    return OPTIONAL


def reasoning_lark(fmt: ReasoningFormat, mode: str, token_ids: Mapping[str, int]) -> str:
    """Lark rules whose `start` runs the reasoning block (as `mode` has it) and then refers to `@answer`. A marker
    the vocabulary holds as one token (`token_ids`: Qwen3's, DeepSeek-R1's) is named by id, and the block's text
    runs until it; a marker spelled out in text ends a lazy lexeme that takes it."""
    if mode == CLOSED:
        return "start: @answer"
    end_id = token_ids.get(fmt.end)
    think = "/(?s:.*)/" if end_id is not None else f"[stop={json.dumps(fmt.end)}]: /(?s:.*)/"
    block = f"think <[{end_id}]> /[ \\t\\n]*/" if end_id is not None else "think /[ \\t\\n]*/"
    if mode == OPTIONAL:
        start_id = token_ids.get(fmt.start)
        block = f"({f'<[{start_id}]>' if start_id is not None else json.dumps(fmt.start)} {block})?"
    rule = f"think: {think}" if end_id is not None else f"think{think}"
    return f"start: {block} @answer\n{rule}"


class ReasoningParser:
    """Owns one request's output split: the text held back and where the block stands."""

    def __init__(self, fmt: ReasoningFormat, mode: str) -> None:
        self.format = fmt
        self.state = "reasoning" if mode == INSIDE else ("answer" if mode == CLOSED else "before")
        self.held = ""
        self.is_answer_started = False

    def feed(self, text: str) -> tuple[str, str]:
        self.held += text
        reasoning = answer = ""
        if self.state == "before":
            opening = self.held.lstrip()
            if not opening or self.format.start.startswith(opening):
                return "", ""  # may still open the block
            if opening.startswith(self.format.start):
                self.held, self.state = opening[len(self.format.start):], "reasoning"
            else:
                self.state = "answer"
        if self.state == "reasoning":
            end = self.held.find(self.format.end)
            if end < 0:
                keep = marker_prefix_len(self.held, self.format.end)
                reasoning, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep:]
                return reasoning, ""
            reasoning, self.held, self.state = self.held[:end], self.held[end + len(self.format.end):], "answer"
        answer, self.held = self._answer(self.held), ""
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        held, self.held = self.held, ""
        if self.state == "reasoning":
            return held, ""
        return "", self._answer(held)

    def _answer(self, text: str) -> str:
        """The answer's text; the whitespace between the block and the answer is left out."""
        if not self.is_answer_started:
            text = text.lstrip()
            self.is_answer_started = bool(text)
        return text


