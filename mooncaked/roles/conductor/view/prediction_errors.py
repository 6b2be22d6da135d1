"""How wrong this conductor's predictions were: every served request's predicted TTFT and TBT against the actual.

1. A request's run calls `record()` when it finishes with at least its first token: the placement's predicted
   TTFT and TBT, the measured TTFT (arrival to first token) and TBT (mean gap between later tokens; None with
   fewer than two tokens).
2. Each record goes into the Prometheus histograms of the relative error and a ring of the last `capacity`.
3. `describe()` answers /v1/cluster: the ring, and over it the mean absolute percentage error and the bias
   (median of predicted / actual) of each, overall and over the first `num_first` requests since start.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from mooncaked.runtime.metrics import PredictionMetrics


@dataclass(frozen=True)
class PredictionRecord:
    request_id: str
    predicted_ttft_s: float
    actual_ttft_s: float
    predicted_tbt_s: float
    actual_tbt_s: float | None


def summary(pairs: list[tuple[float, float]]) -> dict[str, float | int | None]:
    """{count, mape, bias} of (predicted, actual) pairs with a positive actual."""
    valid = [(p, a) for p, a in pairs if a > 0]
    if not valid:
        return {"count": 0, "mape": None, "bias": None}
    return {"count": len(valid), "mape": statistics.fmean(abs(p - a) / a for p, a in valid),
            "bias": statistics.median(p / a for p, a in valid)}


class PredictionErrors:
    """Owns the ring of recent records and the first requests' records (owned by the ClusterView)."""

    def __init__(self, metrics: PredictionMetrics, *, capacity: int = 256, num_first: int = 20) -> None:
        self.metrics = metrics
        self.recent: deque[PredictionRecord] = deque(maxlen=capacity)
        self.first: list[PredictionRecord] = []
        self.num_first = num_first

    def record(self, record: PredictionRecord) -> None:
        if record.actual_ttft_s <= 0:
            return
        tbt_error = None
        if record.actual_tbt_s is not None and record.actual_tbt_s > 0:
            tbt_error = (record.predicted_tbt_s - record.actual_tbt_s) / record.actual_tbt_s
        self.metrics.observe(ttft_error=(record.predicted_ttft_s - record.actual_ttft_s) / record.actual_ttft_s,
                             tbt_error=tbt_error)
        self.recent.append(record)
        if len(self.first) < self.num_first:
            self.first.append(record)

    def describe(self) -> dict[str, Any]:
        return {"ttft": _summaries(self.recent, self.first, "ttft"), "tbt": _summaries(self.recent, self.first, "tbt"),
                "recent": [asdict(r) for r in self.recent]}


def _summaries(recent: deque[PredictionRecord], first: list[PredictionRecord], kind: str) -> dict[str, Any]:
    def pairs(records: list[PredictionRecord] | deque[PredictionRecord]) -> list[tuple[float, float]]:
        found = [(getattr(r, f"predicted_{kind}_s"), getattr(r, f"actual_{kind}_s")) for r in records]
        return [(p, a) for p, a in found if a is not None]

    return {"recent": summary(pairs(recent)), "first": summary(pairs(first))}
