"""Reading tool calls out of a model's streamed output text (the format: tool_formats.py).

1. `ToolCallParser(format)` per request; `feed(text)` takes each text delta and returns the content that is now
   safe to show and the calls completed by it. Text before the tool-call section is content (a suffix that could
   still open the section is held back); the section itself is never content while it reads as calls.
2. `finish()` at the end of the output: the held text, and any section text that did not turn out to be calls
   (a model that opened a call and never closed it, or wrote no call at all), go back as content.
A format without a section marker (Llama 3.1 JSON) has calls only when the whole output is calls: output opening
with `{` or `<|python_tag|>` is held until it either reads as calls or ends.
"""

from __future__ import annotations

from mooncaked.model.tool_formats import ParsedCall, ToolCallFormat

_OPENERS = ("{", "<|python_tag|>")  # how an output of calls opens, for a format without a section marker


class ToolCallParser:
    """Owns one request's output text as far as it was read: the content released, the section, the calls."""

    def __init__(self, tool_format: ToolCallFormat) -> None:
        self.format = tool_format
        self.pending = ""  # content not released yet (it may open the section)
        self.section = ""  # section text not read as calls yet
        self.is_in_section = False
        self.is_decided = bool(tool_format.start)  # markerless formats: whether the output opens with a call
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        if self.is_in_section:
            self.section += text
            return "", self._take()
        self.pending += text
        if not self.format.start:
            return self._feed_markerless()
        start = self.pending.find(self.format.start)
        if start >= 0:
            content, self.section, self.pending = self.pending[:start], self.pending[start:], ""
            self.is_in_section = True
            return content, self._take()
        held = marker_prefix_len(self.pending, self.format.start)
        content, self.pending = self.pending[: len(self.pending) - held], self.pending[len(self.pending) - held:]
        return content, []

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """The rest, at the end of the output: calls still readable, then everything else as content."""
        calls = self._take() if self.is_in_section else []
        rest = self.pending + self.section
        self.pending = self.section = ""
        if self.num_calls and not _without_markers(rest, self.format.markers).strip():
            rest = ""  # only the section's closing markers and whitespace are left
        return rest, calls

    def _feed_markerless(self) -> tuple[str, list[ParsedCall]]:
        if not self.is_decided:
            opening = self.pending.lstrip()
            if not opening or any(o.startswith(opening) for o in _OPENERS):
                return "", []  # too little to tell
            self.is_decided = True
            if opening.startswith(_OPENERS):
                self.is_in_section, self.section, self.pending = True, self.pending, ""
                return "", self._take()
        content, self.pending = self.pending, ""
        return content, []

    def _take(self) -> list[ParsedCall]:
        taken = self.format.take_calls(self.section)
        if taken is None:
            return []
        calls, consumed = taken
        self.section = self.section[consumed:]
        self.num_calls += len(calls)
        return calls


def _without_markers(text: str, markers: tuple[str, ...]) -> str:
    for marker in markers:
        text = text.replace(marker, "")
    return text


def marker_prefix_len(text: str, marker: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0
