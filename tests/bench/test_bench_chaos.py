"""bench chaos end to end, cut short: one decode process killed under load; its requests finish elsewhere."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hypothesis import given
from hypothesis import strategies as st

from mooncaked import cli
from mooncaked.bench.chaos_load import index_of


def test_a_killed_decode_instance_loses_no_request(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "chaos.json"
    code = cli.main(["bench", "chaos", "--victims", "d0", "--rate", "6", "--output-tokens", "200",
                     "--min-wait-s", "1", "--max-wait-s", "1", "--settle-s", "20", "--json", str(out)])
    assert code == 0, capsys.readouterr()
    result = json.loads(out.read_text())
    (kill,) = result["kills"]
    assert kill["victim"] == "d0" and kill["recovery_s"] < 15
    assert result["hung"] == 0 and result["lost"] == 0 and result["leaked"] == 0, result
    assert kill["completed"] == kill["in_flight"] and result["clean_exit"]
    assert kill["held"] >= 1 and kill["held_completed"] == kill["held"]  # killed holding streams: all migrated
    assert result["idle_kills"] == 0 and result["failover_completion"] == 1.0
    assert "d0" in capsys.readouterr().out


def test_unknown_victims_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "chaos", "--victims", "x9"]) == 2
    assert "--victims" in capsys.readouterr().out


@given(st.integers(0, 10**9), st.integers(0, 9), st.text(max_size=20))
def test_a_request_is_found_by_the_id_an_instance_knows_it_by(index: int, attempt: int, tail: str) -> None:
    assert index_of(f"chaos-{index}~{attempt}.{tail}") == index
    assert index_of(f"chaos-{index}") == index
    assert index_of(f"other-{index}~{attempt}") is None
    assert index_of(f"chaos-x{index}~1") is None
