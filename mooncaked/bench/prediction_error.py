"""How far the server's predictions were from what the client measured (mooncaked's X-Mooncaked-Predicted-*).

1. Each streamed response carries the scheduler's predicted TTFT and TBT in its headers; the load generator
   keeps them beside its own measurements (TTFT; TBT as TPOT, the mean gap, which is what a decode step's
   predicted time stands for).
2. `prediction_summary(results)` gives, over the successful requests with predictions and over the first
   `num_first` of them in arrival order: `ttft_prediction_mape`, `tbt_prediction_mape` (mean of |predicted -
   actual| / actual) and `ttft_prediction_bias`, `tbt_prediction_bias` (median of predicted / actual), plus
   the per-request pairs.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from mooncaked.bench.stats import RequestResult, tpot_s

NUM_FIRST = 20


def _pairs(results: Sequence[RequestResult], kind: str) -> list[tuple[float, float]]:
    pairs = []
    for result in results:
        predicted = result.predicted_ttft_s if kind == "ttft" else result.predicted_tbt_s
        actual = result.ttft_s if kind == "ttft" else tpot_s(result)
        if predicted is not None and actual is not None and actual > 0:
            pairs.append((predicted, actual))
    return pairs


def _mape(pairs: list[tuple[float, float]]) -> float | None:
    return statistics.fmean(abs(p - a) / a for p, a in pairs) if pairs else None


def _bias(pairs: list[tuple[float, float]]) -> float | None:
    return statistics.median(p / a for p, a in pairs) if pairs else None


def prediction_summary(results: Sequence[RequestResult], num_first: int = NUM_FIRST) -> dict[str, Any]:
    served = sorted((r for r in results if r.is_success and r.predicted_ttft_s is not None), key=lambda r: r.index)
    summary: dict[str, Any] = {"num_predicted": len(served)}
    for suffix, subset in (("", served), (f"_first{num_first}", served[:num_first])):
        for kind in ("ttft", "tbt"):
            pairs = _pairs(subset, kind)
            summary[f"{kind}_prediction_mape{suffix}"] = _mape(pairs)
            summary[f"{kind}_prediction_bias{suffix}"] = _bias(pairs)
    summary["predictions"] = [
        {"index": r.index, "predicted_ttft_ms": _ms(r.predicted_ttft_s), "ttft_ms": r.ttft_s * 1e3,
         "predicted_tbt_ms": _ms(r.predicted_tbt_s), "tpot_ms": _ms(tpot_s(r)), "num_prompt_tokens": r.num_prompt_tokens,
         "num_output_tokens": r.num_output_tokens} for r in served]
    return summary


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3
