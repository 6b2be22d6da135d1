"""bench chaos end to end, cut short: one decode process killed under load; its requests finish elsewhere."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mooncaked import cli


def test_a_killed_decode_instance_loses_no_request(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "chaos.json"
    code = cli.main(["bench", "chaos", "--victims", "d0", "--rate", "6", "--output-tokens", "200",
                     "--min-wait-s", "1", "--max-wait-s", "1", "--settle-s", "20", "--json", str(out)])
    assert code == 0, capsys.readouterr()
    result = json.loads(out.read_text())
    (kill,) = result["kills"]
    assert kill["victim"] == "d0" and kill["recovery_s"] < 15
    assert kill["victim_held"] > 0, "the decode instance was killed while it held requests"
    assert result["hung"] == 0 and result["lost"] == 0 and result["leaked"] == 0, result
    assert kill["completed"] == kill["in_flight"] and result["clean_exit"]
    assert "d0" in capsys.readouterr().out


def test_unknown_victims_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "chaos", "--victims", "x9"]) == 2
    assert "--victims" in capsys.readouterr().out
