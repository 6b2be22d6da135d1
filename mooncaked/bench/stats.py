"""Serving metrics from client-side timings, as `vllm bench serve` defines them, plus Mooncake's TBT.

1. The load generator records one `RequestResult` per request.
2. `summarize(results, duration_s, slos_ms)` returns the flat metric dict (vLLM's key names):
   completed, failed, rejected, totals, throughputs, request goodput, and mean/median/std/p90/p99 of
   ttft, tpot, itl, e2el and tbt in milliseconds.
Definitions: ttft = first streamed chunk - send; tpot = (e2el - ttft) / (output tokens - 1), only for
requests with more than one output token; itl = every gap between successive streamed chunks, pooled over
requests; tbt (the paper's) = per request, the mean of its longest 10% of gaps (at least one gap); goodput =
completed requests per second that meet every given SLO (a request with no gaps meets tpot and tbt SLOs).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

SLO_METRICS = ("ttft", "tpot", "tbt", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el", "tbt")
PERCENTILES = (90, 99)
TBT_TAIL_FRACTION = 0.1
REJECTED_STATUS = 429


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds."""

    is_success: bool
    status: int  # HTTP status; 0 when no response arrived
    error: str = ""
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    ttft_s: float = 0.0
    e2el_s: float = 0.0
    chunk_gaps_s: list[float] = field(default_factory=list)  # itl: gaps between successive chunks
    index: int = -1  # the request's place in the workload (arrival order)
    predicted_ttft_s: float | None = None  # the server's predictions (X-Mooncaked-Predicted-* headers)
    predicted_tbt_s: float | None = None

    @property
    def is_rejected(self) -> bool:
        return self.status == REJECTED_STATUS


def tpot_s(result: RequestResult) -> float | None:
    if result.num_output_tokens <= 1:
        return None
    return (result.e2el_s - result.ttft_s) / (result.num_output_tokens - 1)


def tbt_s(chunk_gaps_s: Sequence[float]) -> float | None:
    """Mean of the longest 10% of a request's token gaps (Mooncake's TBT); None without gaps."""
    if not chunk_gaps_s:
        return None
    num_tail = max(1, math.ceil(TBT_TAIL_FRACTION * len(chunk_gaps_s)))
    return float(np.mean(sorted(chunk_gaps_s, reverse=True)[:num_tail]))


def parse_goodput(specs: Iterable[str]) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> `{"ttft": 500.0, "tpot": 50.0}` (milliseconds)."""
    slos_ms: dict[str, float] = {}
    for spec in specs:
        name, sep, value = spec.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput {spec!r}: expected NAME:MS with NAME one of {', '.join(SLO_METRICS)}")
        try:
            slos_ms[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {spec!r}: {value!r} is not a number of milliseconds") from None
        if slos_ms[name] <= 0:
            raise ValueError(f"--goodput {spec!r}: the SLO must be positive")
    return slos_ms


def request_metrics_ms(result: RequestResult) -> dict[str, float | None]:
    """One request's SLO metrics in milliseconds (None where undefined)."""
    tpot, tbt = tpot_s(result), tbt_s(result.chunk_gaps_s)
    return {
        "ttft": result.ttft_s * 1e3,
        "tpot": None if tpot is None else tpot * 1e3,
        "tbt": None if tbt is None else tbt * 1e3,
        "e2el": result.e2el_s * 1e3,
    }


def meets_slos(result: RequestResult, slos_ms: dict[str, float]) -> bool:
    values = request_metrics_ms(result)
    return all((values[name] or 0.0) <= limit for name, limit in slos_ms.items())


def distribution_ms(name: str, values_s: Sequence[float]) -> dict[str, float]:
    values_ms = np.asarray(values_s, dtype=np.float64) * 1e3
    if values_ms.size == 0:
        values_ms = np.zeros(1)
    stats = {
        f"mean_{name}_ms": float(values_ms.mean()),
        f"median_{name}_ms": float(np.median(values_ms)),
        f"std_{name}_ms": float(values_ms.std()),
    }
    for p in PERCENTILES:
        stats[f"p{p}_{name}_ms"] = float(np.percentile(values_ms, p))
    return stats


def summarize(
    results: Sequence[RequestResult], duration_s: float, slos_ms: dict[str, float]
) -> dict[str, float | int]:
    completed = [r for r in results if r.is_success]
    num_input = sum(r.num_prompt_tokens for r in completed)
    num_output = sum(r.num_output_tokens for r in completed)
    duration_s = max(duration_s, 1e-9)
    summary: dict[str, float | int] = {
        "duration": duration_s,
        "completed": len(completed),
        "failed": sum(1 for r in results if not r.is_success and not r.is_rejected),
        "rejected": sum(1 for r in results if r.is_rejected),
        "total_input_tokens": num_input,
        "total_output_tokens": num_output,
        "request_throughput": len(completed) / duration_s,
        "output_throughput": num_output / duration_s,
        "total_token_throughput": (num_input + num_output) / duration_s,
    }
    if slos_ms:
        summary["request_goodput"] = sum(1 for r in completed if meets_slos(r, slos_ms)) / duration_s
    per_metric: dict[str, list[float]] = {
        "ttft": [r.ttft_s for r in completed],
        "tpot": [t for t in map(tpot_s, completed) if t is not None],
        "itl": [gap for r in completed for gap in r.chunk_gaps_s],
        "e2el": [r.e2el_s for r in completed],
        "tbt": [t for t in (tbt_s(r.chunk_gaps_s) for r in completed) if t is not None],
    }
    for name in LATENCY_METRICS:
        summary.update(distribution_ms(name, per_metric[name]))
    return summary
