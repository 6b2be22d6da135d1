"""A bench command's report: the table printed, the result written as JSON only when a file was asked for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mooncaked.bench.report import report, write_json


def test_report_prints_the_table_and_writes_the_result(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "result.json"
    report({"ratio": 1.5, "runs": [1, 2]}, "ratio 1.50", str(out))
    assert capsys.readouterr().out == "ratio 1.50\n"
    assert json.loads(out.read_text()) == {"ratio": 1.5, "runs": [1, 2]} and out.read_text().endswith("}\n")


def test_no_file_without_a_path_and_odd_values_as_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report({"a": 1}, "a 1", None)
    assert capsys.readouterr().out == "a 1\n" and not list(tmp_path.iterdir())
    write_json(tmp_path / "odd.json", {"path": tmp_path})
    assert json.loads((tmp_path / "odd.json").read_text()) == {"path": str(tmp_path)}
