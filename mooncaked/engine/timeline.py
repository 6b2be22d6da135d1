"""When each layer's compute, load and store began and ended: the evidence that they overlap.

1. A worker may hold a `LayerTimeline` (tests and `bench layerwise` set one). The layer-wise paths record
   `compute` (the forward's layer i, from the compute thread), `load` (a request's layer i from the store
   read to its pages) and `store` (from the pages->staging copy to the last store write of layer i).
2. `time_of(kind, layer, edge)` answers the earliest start or the latest end of that kind and layer, so tests
   assert order ("layer i+1's load started before layer i's compute ended") rather than durations.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Literal

Kind = Literal["compute", "load", "store"]
Edge = Literal["start", "end"]


@dataclass(frozen=True)
class TimelineEvent:
    kind: Kind
    request_id: str  # "" for compute (a forward serves a batch)
    layer: int
    edge: Edge
    at: float  # time.perf_counter()


class LayerTimeline:
    """Owns its event list; appended to from the compute thread, the copy thread and the event loop."""

    def __init__(self) -> None:
        self._events: list[TimelineEvent] = []
        self._lock = threading.Lock()

    def record(self, kind: Kind, request_id: str, layer: int, edge: Edge) -> None:
        event = TimelineEvent(kind, request_id, layer, edge, time.perf_counter())
        with self._lock:
            self._events.append(event)

    def events(self) -> list[TimelineEvent]:
        with self._lock:
            return list(self._events)

    def time_of(self, kind: Kind, layer: int, edge: Edge) -> float:
        """Earliest start / latest end of `kind` at `layer`; KeyError when none was recorded."""
        times = [e.at for e in self.events() if e.kind == kind and e.layer == layer and e.edge == edge]
        if not times:
            raise KeyError(f"no {kind} {edge} recorded for layer {layer}")
        return min(times) if edge == "start" else max(times)
