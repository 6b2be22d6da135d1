"""Imperfect predictions in the simulator: output-length forecasts in the decode views, and the study's rows."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from mooncaked.sim import cli
from mooncaked.sim.config import SimConfigError, with_overrides
from mooncaked.sim.engine import Simulator
from mooncaked.sim.output_forecast import OutputForecast
from mooncaked.sim.prediction_study import SCHEDULERS, run_prediction_study
from mooncaked.sim.trace import load_trace
from tests.sim.test_sim import _small_config, _write_trace


def test_the_oracle_without_noise_predicts_the_truth_and_the_learned_one_starts_conservative() -> None:
    oracle = OutputForecast("oracle", noise=0.0, max_tokens=100, quantile=0.9, seed=0)
    assert oracle.predict(500, 37) == 37
    noisy = OutputForecast("oracle", noise=0.5, max_tokens=100, quantile=0.9, seed=0)
    assert {noisy.predict(500, 37) for _ in range(20)} != {37}
    learned = OutputForecast("learned", noise=0.0, max_tokens=100, quantile=0.9, seed=0)
    assert learned.predict(500, 37) == 100
    for _ in range(10):
        learned.observe(500, 20)
    assert learned.predict(500, 37) == 20
    assert OutputForecast("uniform", noise=0.0, max_tokens=100, quantile=0.9, seed=0).predict(500, 37) == 0
    with pytest.raises(ValueError):
        OutputForecast("psychic", noise=0.0, max_tokens=100, quantile=0.9, seed=0)


@pytest.mark.parametrize("mode", ["oracle", "learned"])
def test_predicted_rejection_runs_with_per_request_forecasts_deterministically(tmp_path: Path, mode: str) -> None:
    trace = _write_trace(tmp_path / "t.jsonl", num_requests=120)
    config = with_overrides(_small_config(admission="early_rejection_predicted"), "run",
                            output_length_predictor=mode, output_length_noise=0.3, output_length_scale=8.0)
    first = Simulator(config, load_trace(trace)).run()
    second = Simulator(config, load_trace(trace)).run()
    assert [vars(r) for r in first.records] == [vars(r) for r in second.records]
    assert sum(1 for r in first.records if not r.rejection_reason) > 0


def test_the_study_ranks_every_scheduler_and_runs_every_admission_variant(tmp_path: Path) -> None:
    trace = str(_write_trace(tmp_path / "t.jsonl", num_requests=80))
    result = run_prediction_study(trace, _small_config(), [0.0, 0.5])
    scheduling = [r for r in result["rows"] if r["study"] == "prefill_scheduling"]
    assert len(scheduling) == 2 * len(SCHEDULERS)
    assert sorted(r["rank"] for r in scheduling if r["error"] == 0.5) == [1, 2, 3, 4]
    overload = [r for r in result["rows"] if r["study"] == "overload"]
    assert {r["variant"] for r in overload} == {"baseline", "early_rejection", "predicted_uniform_td",
                                                "predicted_oracle", "predicted_learned"}


def test_bad_forecast_settings_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SimConfigError, match="run.output_length_predictor"):
        with_overrides(_small_config(), "run", output_length_predictor="psychic")
    trace = str(_write_trace(tmp_path / "t.jsonl", num_requests=10))
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.run(parser.parse_args(["prediction-study", "--trace", trace, "--errors", "x"])) == 2
    assert "--errors" in capsys.readouterr().err
