"""What `mooncaked bench serve` shows: a live progress line while requests run, the result table at the end.

1. Progress(total) draws one line on stderr (done, rejected, failed, elapsed), redrawn at most 10 times a second
   as each request ends (`update`); `close` ends the line.
2. format_table(result) lays the summary (stats.summarize, with prediction errors and goodput when present) out as
   vLLM's benchmark_serving table: counts and throughputs, then mean, median, p90 and p99 of each latency.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from mooncaked.bench.stats import RequestResult


class Progress:
    """A one-line progress bar on stderr, redrawn at most 10 times a second; owns its counts."""

    def __init__(self, total: int, *, is_enabled: bool) -> None:
        self.total = total
        self.is_enabled = is_enabled
        self.num_done = self.num_rejected = self.num_failed = 0
        self.started = time.perf_counter()
        self.drawn_at = 0.0

    def update(self, result: RequestResult) -> None:
        self.num_done += 1
        self.num_rejected += result.is_rejected
        self.num_failed += not result.is_success and not result.is_rejected
        now = time.perf_counter()
        if self.is_enabled and (now - self.drawn_at >= 0.1 or self.num_done == self.total):
            self.drawn_at = now
            filled = 30 * self.num_done // max(1, self.total)
            sys.stderr.write(
                f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.num_done}/{self.total} "
                f"rejected {self.num_rejected} failed {self.num_failed} {now - self.started:.1f}s"
            )
            sys.stderr.flush()

    def close(self) -> None:
        if self.is_enabled and self.num_done:
            sys.stderr.write("\n")


def format_table(result: dict[str, Any]) -> str:
    rows = [
        ("Completed requests", result["completed"]), ("Rejected requests (429)", result["rejected"]),
        ("Failed requests", result["failed"]), ("Unfinished at the time cap", result["unfinished"]),
        ("Benchmark duration (s)", result["duration"]), ("Total input tokens", result["total_input_tokens"]),
        ("Total generated tokens", result["total_output_tokens"]),
        ("Request throughput (req/s)", result["request_throughput"]),
        ("Output token throughput (tok/s)", result["output_throughput"]),
        ("Total token throughput (tok/s)", result["total_token_throughput"]),
    ]
    for key, title in (("ttft_prediction_mape", "TTFT prediction MAPE"),
                       ("ttft_prediction_bias", "TTFT prediction bias"),
                       ("ttft_prediction_mape_first20", "TTFT prediction MAPE, first 20"),
                       ("tbt_prediction_mape", "TBT prediction MAPE (vs TPOT)")):
        if result.get(key) is not None:
            rows.append((title, result[key]))
    if "request_goodput" in result:
        slos = " ".join(f"{k}:{v:g}" for k, v in result["goodput_slos_ms"].items())
        rows.append((f"Request goodput (req/s) [{slos}]", result["request_goodput"]))
    lines = ["{:=^60}".format(" Serving Benchmark Result ")]
    lines += [f"{name:<44}{_fmt(value):>16}" for name, value in rows]
    for metric, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st)"),
                          ("itl", "Inter-token Latency"), ("tbt", "TBT (mean of longest 10% gaps)"),
                          ("e2el", "End-to-end Latency")):
        lines.append("{:-^60}".format(f" {title} "))
        for stat in ("mean", "median", "p90", "p99"):
            lines.append(f"{f'{stat.capitalize()} {metric.upper()} (ms)':<44}"
                         f"{_fmt(result[f'{stat}_{metric}_ms']):>16}")
    lines.append("=" * 60)
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)
