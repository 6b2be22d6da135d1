"""Decode memory at a request's decode start (paper section 6.2): the forecast that prediction-based early rejection
admits on, run by the conductor, the decode instance's RESERVE and the simulator alike.

1. Every sequence a decode instance holds or has promised to hold is a `DecodeHold`: its KV pages (prompt and
   max_tokens, as the decode role allocates them: `num_pages_for`, a parallel sampling's prompt pages once)
   from `starts_at` (now for a running sequence; the predicted decode start for a placed one) until `ends_at`
   (its predicted end, from the output-length predictor). A request whose only token is its prefill's first
   (`is_decoding` false: max_tokens 1, prefilled elsewhere) holds nothing: its decode instance commits the
   prefilled blocks to its store and never runs it (`decode_num_pages` is 0 and it takes no batch slot).
2. `peak_use` gives the most pages and sequences held at once over a time window: at its start and at every
   later hold's start inside it (holds only end between those times, so the peak is at one of them).
3. `forecast_refusal` admits a new hold when, over its whole predicted life, the peak leaves room for its pages
   and its batch slot; otherwise the reason names what runs short. `earliest_fit` finds the earliest later start
   at which it would fit (room only appears when a hold ends), for a request whose prefill may finish before its
   decode can start. A forecast can be wrong (a sequence runs
   longer than predicted): the decode instance then makes the request wait for its pages, bounded by a deadline
   (roles/worker/decode/), and the forecast only decides what is refused before any prefill.

Pure: no I/O, no clock; `now` and every time are passed in, in seconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeHold:
    """One sequence's claim on a decode instance: `num_pages` KV pages over [starts_at, ends_at)."""

    num_pages: int
    starts_at: float
    ends_at: float
    num_seqs: int = 1  # batch slots: a parallel sampling's sequences

    def is_held_at(self, at_time: float) -> bool:
        return self.starts_at <= at_time < self.ends_at


def num_pages_for(num_prompt_tokens: int, max_tokens: int, block_size: int, num_sequences: int = 1) -> int:
    """The pages a decode instance allocates for a request: its prompt and every token it may generate. A parallel
    sampling's `num_sequences` share the prompt's full blocks (once) and each has its own partial last block and
    output pages."""
    num_shared = num_prompt_tokens // block_size
    num_own = -(-(num_prompt_tokens + max_tokens) // block_size) - num_shared
    return num_shared + num_own * num_sequences


def is_decoding(max_tokens: int, is_inline_prefill: bool) -> bool:
    """Whether a request runs in its decode instance's batch at all: not when its prefill's first token is all it
    asks for (max_tokens 1) and that prefill runs elsewhere. max_tokens 0 (unknown) decodes."""
    return max_tokens != 1 or is_inline_prefill


def decode_num_pages(num_prompt_tokens: int, max_tokens: int, block_size: int, num_sequences: int = 1, *,
                     is_inline_prefill: bool) -> int:
    """The pages a decode instance takes for a request: `num_pages_for`, or none when it does not decode."""
    if not is_decoding(max_tokens, is_inline_prefill):
        return 0
    return num_pages_for(num_prompt_tokens, max_tokens, block_size, num_sequences)


def peak_use(holds: Sequence[DecodeHold], starts_at: float, ends_at: float) -> tuple[int, int]:
    """(pages, sequences) at their highest over [starts_at, ends_at)."""
    times = [starts_at] + [h.starts_at for h in holds if starts_at < h.starts_at < ends_at]
    peak_pages = peak_seqs = 0
    for at_time in times:
        held = [h for h in holds if h.is_held_at(at_time)]
        peak_pages = max(peak_pages, sum(h.num_pages for h in held))
        peak_seqs = max(peak_seqs, sum(h.num_seqs for h in held))
    return peak_pages, peak_seqs


def forecast_refusal(new: DecodeHold, holds: Sequence[DecodeHold], num_pages: int, max_num_seqs: int) -> str:
    """Why `new` does not fit beside `holds` over its predicted life ("" when it does); a reason starts with
    memory or batch, as the decode instance's own refusals do."""
    peak_pages, peak_seqs = peak_use(holds, new.starts_at, max(new.ends_at, new.starts_at + 1e-9))
    if peak_pages + new.num_pages > num_pages:
        return (f"memory: needs {new.num_pages} KV pages at its predicted decode start, {num_pages - peak_pages} "
                f"of {num_pages} predicted free")
    if peak_seqs + new.num_seqs > max_num_seqs:
        return f"batch: {peak_seqs} sequences predicted at its decode start (max {max_num_seqs})"
    return ""


def earliest_fit(new: DecodeHold, holds: Sequence[DecodeHold], num_pages: int, max_num_seqs: int,
                 latest_start: float) -> float | None:
    """The earliest start in [new.starts_at, latest_start] at which `new`, moved there with its length, fits
    beside `holds` (None when none does): its own start, or the end of a hold."""
    length = new.ends_at - new.starts_at
    ends = sorted({h.ends_at for h in holds if new.starts_at < h.ends_at <= latest_start})
    for start in [new.starts_at, *ends]:
        moved = DecodeHold(new.num_pages, start, start + length, new.num_seqs)
        if not forecast_refusal(moved, holds, num_pages, max_num_seqs):
            return start
    return None
