"""From the conductor's live state to the plain views the scheduling policy reads (sched/types.py).

1. `WorkerState` is what the conductor knows of one prefill or decode instance: its last LOAD reply and when
   it came, whether it is up. `InFlight` is one of this conductor's requests between placement and its end.
2. `prefill_view`: the instance's own predicted held work (LOAD's `pending_work_s`, less the time since the
   reply) plus this conductor's requests the reply did not count yet, its fitted model and per-request overhead.
   A prefill group's first stage reports the group's queue and its pipeline (`pipeline_spec`).
3. `decode_view`: the running batch and the requests placed there that decode, with per-request predicted ends
   from the output-length predictor (each request's remaining tokens times the instance's predicted step time).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from mooncaked.config import InstanceConfig
from mooncaked.roles.conductor.view.outages import OutageHistory
from mooncaked.roles.conductor.view.predictors import LivePredictors
from mooncaked.roles.worker.messages import LoadReply
from mooncaked.sched.decode_memory import DecodeHold, num_pages_for
from mooncaked.sched.output_length import OutputLengthPredictor
from mooncaked.sched.types import DecodeInstanceView, PipelineSpec, PrefillInstanceView


@dataclass
class WorkerState:
    instance: InstanceConfig
    store_id: str  # the store on its host ("" when none is configured)
    max_num_running: int
    default_max_context_tokens: int  # until the first LOAD reply tells the real page count
    load: LoadReply | None = None
    polled_at: float = 0.0  # time.monotonic() when `load` arrived
    is_up: bool = False
    last_error: str = ""
    has_polled: asyncio.Event = field(default_factory=asyncio.Event)
    state: str = "ready"  # its membership state: only a ready instance gets new work
    outages: OutageHistory = field(default_factory=OutageHistory)
    down_watchers: set[Callable[[], None]] = field(default_factory=set)  # called at each report of it down

    @property
    def is_placeable(self) -> bool:
        return self.is_up and self.state == "ready"


@dataclass
class InFlight:
    request_id: str
    prefill_instance: str  # "" when prefilled inline on the decode instance
    decode_instance: str
    predicted_prefill_s: float
    dispatched_at: float
    ready_at: float  # predicted decode start
    num_context_tokens: int
    max_tokens: int = 1
    client_id: str = ""
    num_sequences: int = 1  # a parallel sampling's: batch slots, sharing their prompt's pages
    is_prefilled: bool = False
    decode_started_at: float | None = None
    num_generated: int = 0
    is_decoding: bool = True  # false: its prefill's first token ends it (sched/decode_memory.is_decoding)


@dataclass(frozen=True)
class OutputForecast:
    """The output-length predictor and what to assume of requests it knows nothing about."""

    predictor: OutputLengthPredictor
    default_max_tokens: int
    is_enabled: bool  # False: the policy's uniform decode time t_d (the paper's prediction-based rejection)

    def remaining_tokens(self, flight: InFlight) -> int:
        total = self.predictor.predict(api_key=flight.client_id, max_tokens=flight.max_tokens,
                                       num_prompt_tokens=flight.num_context_tokens,
                                       num_generated=flight.num_generated)
        return max(total - flight.num_generated, 1)

    def tokens_for(self, client_id: str, max_tokens: int, num_prompt_tokens: int) -> int:
        """A new request's predicted output tokens (0 when output lengths are not predicted: the uniform t_d)."""
        if not self.is_enabled:
            return 0
        return min(self.predictor.predict(api_key=client_id, max_tokens=max_tokens,
                                          num_prompt_tokens=num_prompt_tokens), max_tokens)

    def unknown_tokens(self, num_prompt_tokens: int) -> int:
        return self.predictor.predict(api_key="", max_tokens=self.default_max_tokens,
                                      num_prompt_tokens=num_prompt_tokens)


def prefill_view(worker: WorkerState, flights: list[InFlight], predictors: LivePredictors,
                 now: float) -> PrefillInstanceView:
    """`flights`: this conductor's requests placed on `worker` and not yet prefilled, oldest first."""
    name, load = worker.instance.name, worker.load
    coefficients = predictors.prefill_for(name).coefficients if predictors.has_model(name)["prefill"] else ()
    if load is None or not load.prefill_coefficients:
        busy_until = flights[0].dispatched_at + flights[0].predicted_prefill_s if flights else 0.0
        queued_s = sum(f.predicted_prefill_s for f in flights[1:])
        return PrefillInstanceView(name, worker.store_id, busy_until, queued_s, len(flights), worker.is_placeable,
                                   coefficients)
    held = set(load.held_request_ids)
    reported_s = max(load.pending_work_s - (now - worker.polled_at), 0.0)
    mine_s = sum(f.predicted_prefill_s for f in flights if f.request_id not in held)
    num_queued = max(len(flights), load.num_waiting + load.num_running)
    return PrefillInstanceView(name, worker.store_id, now, reported_s + mine_s, num_queued, worker.is_placeable,
                               coefficients, load.overhead_s)


def pipeline_spec(load: LoadReply | None) -> PipelineSpec | None:
    """A prefill group's pipeline from its first stage's LOAD reply; None until every stage reported a model (or
    when the reply's pipeline does not form one)."""
    if load is None or len(load.pipeline_stages) < 2:
        return None
    try:
        return PipelineSpec(tuple(tuple(c) for c in load.pipeline_stages), load.cpp_chunk_tokens,
                            tuple(load.pipeline_handoffs_s))
    except ValueError:
        return None


def inline_wait_s(worker: WorkerState, flights: list[InFlight], predictors: LivePredictors, now: float) -> float:
    """Predicted wait of an inline prefill placed on decode instance `worker` now for its compute thread: half
    the running decode step (it arrives at a uniformly random point of it) and the inline prefills queued ahead.
    `flights`: this conductor's requests placed on `worker`."""
    running = [f for f in flights if f.decode_started_at is not None]
    num_running = len(running)
    num_context_tokens = sum(f.num_context_tokens + f.num_generated for f in running)
    if worker.load is not None:
        num_running = max(num_running, worker.load.num_running)
        num_context_tokens = max(num_context_tokens, worker.load.num_context_tokens)
    step_s = predictors.decode_for(worker.instance.name).predict(num_running, num_context_tokens)
    ahead_s = sum(min(f.predicted_prefill_s, max(f.ready_at - now, 0.0)) for f in flights
                  if not f.prefill_instance and f.decode_started_at is None)
    return (step_s / 2 if num_running else 0.0) + ahead_s


def page_holds(load: LoadReply | None, flights: list[InFlight], forecast: OutputForecast, block_size: int,
               step_s: float, now: float) -> tuple[DecodeHold, ...]:
    """Every sequence's KV pages on a decode instance over its predicted life (sched/decode_memory.py): this
    conductor's requests from their decode start (now once decoding) for their predicted remaining output (their
    max_tokens without a predictor), and the pages LOAD says are in use beyond those, as other conductors'
    requests that just started (the pages in use less those of this conductor's decoding requests)."""
    holds = []
    num_pages_decoding = num_decoding = 0
    for f in flights:
        num_pages = num_pages_for(f.num_context_tokens, f.max_tokens, block_size, f.num_sequences)
        starts_at = now if f.decode_started_at is not None else max(f.ready_at, now)
        num_left = forecast.remaining_tokens(f) if forecast.is_enabled else max(f.max_tokens - f.num_generated, 1)
        holds.append(DecodeHold(num_pages, starts_at, starts_at + num_left * step_s, f.num_sequences))
        if f.decode_started_at is not None:
            num_pages_decoding += num_pages
            num_decoding += f.num_sequences
    if load is not None:
        # Only this conductor's decoding requests hold pages now: one still in prefill takes its pages at DECODE.
        num_others = load.num_pages - load.num_free_pages - num_pages_decoding
        if num_others > 0:
            num_prompt_tokens = load.num_context_tokens // max(load.num_running, 1)
            # batch slots only for sequences LOAD reports beyond this conductor's: pages of a sequence that just
            # ended (freed a moment after it left the batch) or of a reservation hold no slot
            holds.append(DecodeHold(num_others, now, now + forecast.unknown_tokens(num_prompt_tokens) * step_s,
                                    num_seqs=max(load.num_running - num_decoding, 0)))
    return tuple(holds)


def decode_view(worker: WorkerState, flights: list[InFlight], predictors: LivePredictors, forecast: OutputForecast,
                block_size: int, now: float) -> DecodeInstanceView:
    """`flights`: this conductor's requests placed on `worker` (decoding, or still being prefilled); one that
    does not decode there (`InFlight.is_decoding`) is no load of it."""
    flights = [f for f in flights if f.is_decoding]
    running = [f for f in flights if f.decode_started_at is not None]
    started_at = [f.decode_started_at or now for f in running]
    tokens = [f.num_context_tokens + f.num_generated for f in running]
    num_running, num_context_tokens = len(flights), sum(f.num_context_tokens for f in flights)
    max_context_tokens = worker.default_max_context_tokens
    num_others = 0
    load = worker.load
    if load is not None:
        max_context_tokens = load.num_pages * block_size
        num_others = load.num_running - len(running)
        if num_others > 0:  # requests of other conductors: assume they just started
            other_tokens = max(load.num_context_tokens - sum(tokens), 0) // num_others
            started_at += [now] * num_others
            tokens += [other_tokens] * num_others
        num_running = max(num_running, load.num_running + load.num_waiting)
        num_context_tokens = max(num_context_tokens, load.num_context_tokens)
    incoming = [f for f in flights if f.decode_started_at is None]
    model = predictors.decode_for(worker.instance.name)
    has_model = predictors.has_model(worker.instance.name)["decode"]
    step_s = model.predict(max(num_running, 1), num_context_tokens)
    view = DecodeInstanceView(
        worker.instance.name, worker.store_id, num_running, num_context_tokens, worker.max_num_running,
        max_context_tokens, tuple(started_at), tuple(tokens),
        tuple((f.ready_at, f.num_context_tokens) for f in incoming), worker.is_placeable,
        step_coefficients=model.coefficients if has_model else (),
        num_pages=load.num_pages if load is not None else 0,
        page_holds=page_holds(load, flights, forecast, block_size, step_s, now))
    if not forecast.is_enabled:
        return view
    ends_at = [now + forecast.remaining_tokens(f) * step_s for f in running]
    ends_at += [now + forecast.unknown_tokens(t) * step_s for t in tokens[len(running):]]
    decode_s = [forecast.remaining_tokens(f) * step_s for f in incoming]
    return replace(view, running_ends_at=tuple(ends_at), incoming_decode_s=tuple(decode_s))
