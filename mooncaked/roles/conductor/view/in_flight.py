"""This conductor's requests between placement and their end: the queue model between LOAD polls.

1. `begin` when a leg is placed: its predicted prefill time (the prefill instance's queue), predicted decode
   start and context (the decode instance's incoming requests), its max_tokens and client (output-length keys),
   and whether it decodes at all (not when its prefill's first token ends it: sched/decode_memory.is_decoding).
2. `prefill_done`, `decode_started` and `generated` as the leg advances; `finish` when it is settled.
3. The instance views read `on_prefill(name)` / `on_decode(name)`; `num_waiting()` feeds the queue metrics.
"""

from __future__ import annotations

from mooncaked.roles.conductor.view.instances import InFlight
from mooncaked.sched.decode_memory import is_decoding
from mooncaked.sched.types import Placement, RequestInfo


class InFlightTable:
    """Owns the in-flight legs of this conductor, by leg id (owned by the ClusterView)."""

    def __init__(self) -> None:
        self._flights: dict[str, InFlight] = {}

    def __len__(self) -> int:
        return len(self._flights)

    def begin(self, request: RequestInfo, placement: Placement, now: float, *, max_tokens: int = 1,
              client_id: str = "") -> None:
        self._flights[request.request_id] = InFlight(
            request.request_id, placement.prefill_instance, placement.decode_instance,
            placement.predicted_prefill_s, now, now + placement.predicted_decode_start_s, request.num_prompt_tokens,
            max_tokens=max_tokens, client_id=client_id, is_prefilled=not placement.prefill_instance,
            num_sequences=request.num_sequences,
            is_decoding=is_decoding(request.max_tokens, is_inline_prefill=not placement.prefill_instance))

    def prefill_done(self, request_id: str) -> None:
        flight = self._flights.get(request_id)
        if flight is not None:
            flight.is_prefilled = True

    def decode_started(self, request_id: str, now: float) -> None:
        flight = self._flights.get(request_id)
        if flight is not None:
            flight.is_prefilled, flight.decode_started_at = True, now

    def generated(self, request_id: str, num_generated: int) -> None:
        flight = self._flights.get(request_id)
        if flight is not None:
            flight.num_generated = num_generated

    def finish(self, request_id: str) -> None:
        self._flights.pop(request_id, None)

    def on_prefill(self, instance: str) -> list[InFlight]:
        """Legs placed on prefill `instance` and not prefilled yet, oldest first."""
        flights = (f for f in self._flights.values() if f.prefill_instance == instance and not f.is_prefilled)
        return sorted(flights, key=lambda f: f.dispatched_at)

    def on_decode(self, instance: str) -> list[InFlight]:
        return [f for f in self._flights.values() if f.decode_instance == instance]

    def num_waiting(self) -> tuple[int, int]:
        """(legs waiting for or in prefill, legs placed on decode that have not started decoding)."""
        flights = self._flights.values()
        return (sum(1 for f in flights if not f.is_prefilled),
                sum(1 for f in flights if f.decode_started_at is None))
