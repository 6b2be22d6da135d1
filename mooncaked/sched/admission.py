"""Decode choice and admission (paper section 4.3): when and against which decode load a request is refused.

1. `select_decode` picks the decode instance with the lowest predicted TBT (Algorithm 1 line 17). Which load
   it predicts depends on the admission policy:
   - `none`, `baseline`, `early_rejection`: the running batch now, plus this request;
   - `early_rejection_predicted`: the batch at this request's predicted prefill completion `ready_time`:
     running requests predicted to end by then have left, requests placed here whose prefill ends by then have
     joined (section 4.3.4). A request's decode time is its own prediction when the view carries one (output-
     length prediction), else the paper's uniform t_d (`decode_time_s`). When the memory forecast has no room
     at `ready_time` but has by `ready_time + max_defer_s`, the instance has room with its decode start deferred
     to then (`decode_defer_s`): the prefill runs now, the conductor holds the first token back until the
     decode starts, and the decode instance's reservation waits for the pages the forecast frees by then. The
     caller bounds the deferral by the TTFT SLO less the predicted TTFT and by `max_decode_defer_s`.
2. `rejects_at_arrival` says whether the policy refuses up front on that TBT: never for `none` and `baseline`;
   `admission_rejection` is the check at arrival every placement runs (Algorithm 1 lines 18-19): the TTFT SLO
   (every policy but `none`), then the decode instance's room and predicted TBT (early rejection).
3. What a decode instance itself refuses (RESERVE, and under `baseline` its check after prefill) is
   sched/decode_admission.py.
4. Each TBT comes from the instance's own fitted step model when its view carries one (`step_model`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mooncaked.sched.decode_memory import DecodeHold, earliest_fit, forecast_refusal
from mooncaked.sched.predictors import DecodeStepPredictor
from mooncaked.sched.types import (REASON_DECODE_FULL, REASON_TBT_SLO, REASON_TTFT_SLO, DecodeInstanceView,
                                   PolicyConfig, Rejection)


@dataclass(frozen=True)
class DecodeChoice:
    """The chosen decode instance (None when none is available) and its predicted TBT with this request."""

    view: DecodeInstanceView | None
    predicted_tbt_s: float
    has_room: bool
    decode_defer_s: float = 0.0  # its decode starts this long after `ready_time` (the forecast's room then)


def rejects_at_arrival(config: PolicyConfig) -> bool:
    """True when the decode load is checked before prefill (early rejection, with or without prediction)."""
    return config.admission in ("early_rejection", "early_rejection_predicted")


def current_batch(view: DecodeInstanceView) -> tuple[int, int]:
    """(batch size, context tokens) of the running batch."""
    return view.num_running, view.num_context_tokens


def step_model(view: DecodeInstanceView, default: DecodeStepPredictor) -> DecodeStepPredictor:
    """The instance's own fitted step model when it reported one, else `default`."""
    if len(view.step_coefficients) == 3:
        c0, c1, c2 = view.step_coefficients
        return DecodeStepPredictor((c0, c1, c2))
    return default


def predicted_batch(view: DecodeInstanceView, at_time: float, decode_time_s: float) -> tuple[int, int]:
    """(batch size, context tokens) expected at `at_time`: per-request predicted ends when the view has them,
    else a uniform decode time per request."""
    num_running = 0
    num_tokens = 0
    has_ends = len(view.running_ends_at) == len(view.running_started_at)
    for i, (started_at, tokens) in enumerate(zip(view.running_started_at, view.running_tokens)):
        ends_at = view.running_ends_at[i] if has_ends else started_at + decode_time_s
        if ends_at > at_time:
            num_running += 1
            num_tokens += tokens
    has_decode_s = len(view.incoming_decode_s) == len(view.incoming)
    for j, (ready_at, tokens) in enumerate(view.incoming):
        decode_s = view.incoming_decode_s[j] if has_decode_s else decode_time_s
        if ready_at <= at_time < ready_at + decode_s:
            num_running += 1
            num_tokens += tokens
    return num_running, num_tokens


def select_decode(
    num_context_tokens: int,
    decode_views: Sequence[DecodeInstanceView],
    config: PolicyConfig,
    predictor: DecodeStepPredictor,
    now: float,
    ready_time: float,
    *,
    num_pages: int = 0,
    num_output_tokens: int = 0,
    max_defer_s: float = 0.0,
    num_sequences: int = 1,
) -> DecodeChoice:
    """SelectDecodingInstance: the available instance with the lowest predicted TBT once this request joins.

    Instances with room are preferred; ties go to the earlier view. Room is the batch's slots and context now,
    or, under `early_rejection_predicted` with the request's `num_pages` and the view's pages known, the pages and
    slots forecast over the request's predicted decode life (sched/decode_memory.py): from `ready_time` for its
    predicted output (`num_output_tokens` at the predicted step; the uniform t_d when none), or deferred by at
    most `max_defer_s` (step 1); an instance with room at `ready_time` is preferred to a deferred one. A parallel
    sampling's `num_sequences` each take a batch slot and attend over the context (`num_pages` counts their
    shared prompt pages once). With `num_sequences` 0 the request does not decode (decode_memory.is_decoding):
    every available instance has room, the least loaded is chosen, and its own TBT is 0.
    """
    best: DecodeChoice = DecodeChoice(None, float("inf"), False)
    best_tbt = float("inf")
    is_predicted = config.admission == "early_rejection_predicted"
    for view in decode_views:
        if not view.is_available:
            continue
        if is_predicted:
            num_running, num_tokens = predicted_batch(view, ready_time, config.decode_time_s)
        else:
            num_running, num_tokens = current_batch(view)
        num_running += num_sequences
        num_tokens += num_context_tokens * num_sequences
        tbt = step_model(view, predictor).predict(num_running, num_tokens)
        defer_s = 0.0
        if not num_sequences:
            has_room = True
        elif is_predicted and num_pages and view.num_pages:
            decode_s = num_output_tokens * tbt if num_output_tokens else config.decode_time_s
            hold = DecodeHold(num_pages, ready_time, ready_time + decode_s, num_sequences)
            starts_at = earliest_fit(hold, view.page_holds, view.num_pages, view.max_num_running,
                                     ready_time + max(max_defer_s, 0.0))
            has_room = starts_at is not None
            if starts_at is not None and starts_at > ready_time:
                defer_s = starts_at - ready_time
                num_running, num_tokens = predicted_batch(view, starts_at, config.decode_time_s)
                tbt = step_model(view, predictor).predict(num_running + num_sequences,
                                                          num_tokens + num_context_tokens * num_sequences)
        else:
            has_room = num_running <= view.max_num_running and num_tokens <= view.max_context_tokens
        if (has_room, -defer_s, -tbt) > (best.has_room, -best.decode_defer_s, -best_tbt):
            best, best_tbt = DecodeChoice(view, tbt if num_sequences else 0.0, has_room, defer_s), tbt
    return best


def admission_rejection(request_id: str, config: PolicyConfig, ttft_s: float,
                        decode: DecodeChoice) -> Rejection | None:
    """Why a request placed with predicted TTFT `ttft_s` on `decode` is refused at arrival (None: admitted)."""
    if config.admission == "none":
        return None
    tbt_s = decode.predicted_tbt_s
    if ttft_s > config.ttft_slo_s:
        return Rejection(request_id, REASON_TTFT_SLO, ttft_s, tbt_s)
    if rejects_at_arrival(config):
        if not decode.has_room:
            return Rejection(request_id, REASON_DECODE_FULL, ttft_s, tbt_s)
        if tbt_s > config.tbt_slo_s * config.decode_load_threshold:
            return Rejection(request_id, REASON_TBT_SLO, ttft_s, tbt_s)
    return None
