"""`mooncaked sim pd-study`: the switch planner under phase changes with noisy load signals, against a static
split and an oracle that switches once at each phase boundary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncaked.cli import main
from mooncaked.sim.pd_study import PdStudyConfig, best_split, run_pd_study, run_variant


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31))
def test_under_noise_the_planner_switches_once_per_phase_change_and_comes_close_to_the_oracle(seed: int) -> None:
    result = run_pd_study(PdStudyConfig(seed=seed))  # every load sample x U[0.7, 1.5]
    assert result["switches_per_phase_change"] <= 1.0
    assert result["goodput_vs_oracle"] >= 0.9
    assert result["goodput_vs_static"] > 1.3


def test_without_phase_changes_nothing_switches() -> None:
    assert run_variant(PdStudyConfig(num_phases=1, phase_s=300.0), "planner")["num_switches"] == 0


def test_the_oracle_moves_to_each_phase_s_best_split() -> None:
    config = PdStudyConfig()
    assert best_split(config, {"prefill": 2.6, "decode": 1.6}) == 3
    assert best_split(config, {"prefill": 1.6, "decode": 2.6}) == 2
    assert run_variant(config, "oracle")["num_switches"] == config.num_phases - 1


def test_the_cli_prints_and_writes_the_study(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "pd.json"
    assert main(["sim", "pd-study", "--phases", "2", "--json", str(out)]) == 0
    assert "planner goodput / static" in capsys.readouterr().out
    assert json.loads(out.read_text())["variants"]["planner"]["num_switches"] == 1
    assert main(["sim", "pd-study", "--noise", "1.5,0.7"]) == 2
