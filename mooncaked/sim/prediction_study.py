"""How the paper's results change as predictions get worse (`mooncaked sim prediction-study`).

The simulator's predictions are exact by construction; here they are not. For each error level e:
1. Figure 5 (prefill scheduling, admission `none`): true prefill times are the predicted ones times a
   log-normal factor of sigma e (`run.prefill_noise`); the schedulers' mean and p90 TTFT, and their order.
2. Overload (8P + 8D at 2x, section 7.6, outputs x16 so that decode is the bottleneck and the decode-side
   prediction decides) under the same prefill noise: `baseline`, `early_rejection`, and
   `early_rejection_predicted` with the paper's uniform t_d (calibrated from the baseline run), with an
   output-length predictor of error e (the true length times a log-normal factor of sigma e), and with the
   learned online predictor: rejections, wasted prefills and SLO attainment.
`rows` flattens both for the JSON; `format_rows` prints them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mooncaked.sim.config import SimConfig, with_overrides
from mooncaked.sim.engine import Simulator
from mooncaked.sim.results import SimResult, summarize
from mooncaked.sim.trace import load_trace

SCHEDULERS = ("random", "load_balancing", "cache_aware", "kvcache_centric")
DEFAULT_ERRORS = (0.0, 0.1, 0.3, 0.5)


def _run(trace: str, config: SimConfig) -> SimResult:
    return Simulator(config, load_trace(trace, config.run.speed, config.run.max_requests)).run()


def _decode_time_s(result: SimResult) -> float:
    durations = [r.finished_s - r.arrival_s - r.ttft_s for r in result.records
                 if not r.rejection_reason and r.output_length > 1]
    return max(sum(durations) / len(durations), 0.1) if durations else 5.0


def scheduling_rows(trace: str, base: SimConfig, error: float) -> list[dict[str, Any]]:
    config = with_overrides(with_overrides(base, "scheduler", admission="none"), "run", prefill_noise=error)
    rows = []
    for scheduler in SCHEDULERS:
        summary = summarize(_run(trace, with_overrides(config, "scheduler", scheduler=scheduler)))
        rows.append({"study": "prefill_scheduling", "error": error, "variant": scheduler,
                     "ttft_mean_s": summary["ttft_mean_s"], "ttft_p90_s": summary["ttft_p90_s"]})
    order = sorted(rows, key=lambda r: r["ttft_mean_s"])
    for rank, row in enumerate(order, 1):
        row["rank"] = rank
    return rows


def overload_rows(trace: str, base: SimConfig, error: float, output_length_scale: float = 16.0) -> list[dict[str, Any]]:
    config = with_overrides(base, "cluster", num_prefill=8, num_decode=8)
    config = with_overrides(config, "run", speed=2.0, prefill_noise=error, output_length_scale=output_length_scale)
    baseline = _run(trace, with_overrides(config, "scheduler", admission="baseline"))
    predicted = with_overrides(config, "scheduler", admission="early_rejection_predicted",
                               decode_time_s=_decode_time_s(baseline))
    variants = {
        "early_rejection": with_overrides(config, "scheduler", admission="early_rejection"),
        "predicted_uniform_td": predicted,
        "predicted_oracle": with_overrides(predicted, "run", output_length_predictor="oracle",
                                           output_length_noise=error),
        "predicted_learned": with_overrides(predicted, "run", output_length_predictor="learned"),
    }
    results = {"baseline": baseline, **{name: _run(trace, c) for name, c in variants.items()}}
    rows = []
    for name, result in results.items():
        summary = summarize(result)
        rows.append({"study": "overload", "error": error, "variant": name,
                     "num_rejected": summary["num_rejected"], "num_wasted_prefills": summary["num_wasted_prefills"],
                     "slo_attainment": summary["slo_attainment"], "ttft_p90_s": summary["ttft_p90_s"],
                     "tbt_p90_s": summary["tbt_p90_s"]})
    return rows


def run_prediction_study(trace: str, base: SimConfig, errors: Sequence[float] = DEFAULT_ERRORS) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for error in errors:
        rows += scheduling_rows(trace, base, error)
        rows += overload_rows(trace, base, error)
    return {"errors": list(errors), "rows": rows}


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
    lines = []
    for study, columns in (("prefill_scheduling", ("rank", "ttft_mean_s", "ttft_p90_s")),
                           ("overload", ("num_rejected", "num_wasted_prefills", "slo_attainment", "ttft_p90_s",
                                         "tbt_p90_s"))):
        lines.append(f"== {study} ==")
        lines.append(f"{'error':>6} {'variant':<22}" + "".join(f"{c[:14]:>15}" for c in columns))
        for row in (r for r in rows if r["study"] == study):
            cells = "".join(f"{_cell(row[c]):>15}" for c in columns)
            lines.append(f"{row['error']:>6g} {row['variant']:<22}{cells}")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
