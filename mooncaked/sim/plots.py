"""PNG plots of a simulation run (matplotlib, Agg backend): TTFT/TBT CDFs and pool loads over time."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from mooncaked.sim.results import SimResult


def _pyplot():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latency_cdfs(runs: Mapping[str, SimResult], path: Path, ttft_slo_s: float, tbt_slo_s: float) -> None:
    """TTFT and TBT CDFs of served requests, one line per run."""
    plt = _pyplot()
    figure, (ttft_axes, tbt_axes) = plt.subplots(1, 2, figsize=(10, 3.6))
    for label, result in runs.items():
        served = [r for r in result.records if not r.rejection_reason]
        ttfts = sorted(r.ttft_s for r in served)
        tbts = sorted(r.tbt_s * 1000 for r in served if r.output_length > 1)
        for axes, values in ((ttft_axes, ttfts), (tbt_axes, tbts)):
            if values:
                axes.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=label)
    ttft_axes.axvline(ttft_slo_s, color="grey", linestyle="--", linewidth=0.8)
    tbt_axes.axvline(tbt_slo_s * 1000, color="grey", linestyle="--", linewidth=0.8)
    ttft_axes.set(xlabel="TTFT (s)", ylabel="CDF", xscale="log", title="TTFT")
    tbt_axes.set(xlabel="TBT (ms)", ylabel="CDF", xscale="log", title="TBT (mean of longest 10% gaps)")
    ttft_axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def plot_loads(runs: Mapping[str, SimResult], path: Path) -> None:
    """Prefill busy fraction and decode load (step time / TBT SLO) over time, one panel per run."""
    plt = _pyplot()
    figure, axes_list = plt.subplots(len(runs), 1, figsize=(10, 2.2 * len(runs)), sharex=True, squeeze=False)
    for axes, (label, result) in zip(axes_list[:, 0], runs.items()):
        times = [s.time_s for s in result.samples]
        axes.plot(times, [s.prefill_load for s in result.samples], label="prefill load", color="tab:green")
        axes.plot(times, [s.decode_load for s in result.samples], label="decode load", color="tab:orange")
        axes.set(ylabel="load", title=label)
        axes.legend(fontsize=7, loc="upper right")
    axes_list[-1, 0].set(xlabel="time (s)")
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)
