"""A batch's journal of answered lines: appended once each, fsync'd, read back with a torn last line cut."""

from __future__ import annotations

from pathlib import Path

from mooncaked.roles.conductor.batch.journal import BatchRecord, Journal, load_records, save_record


async def test_lines_are_answered_once_and_survive_reopening(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    journal = Journal.open(path)
    assert await journal.append(3, True, {"custom_id": "c"})
    assert not await journal.append(3, False, {"custom_id": "again"})
    assert await journal.append(1, False, {"custom_id": "a"})
    reopened = Journal.open(path)
    assert reopened.answered == {1, 3}
    assert [(e.number, e.is_ok, e.record["custom_id"]) for e in reopened.entries] == [(3, True, "c"), (1, False, "a")]


async def test_a_torn_last_line_is_cut_and_that_line_runs_again(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    journal = Journal.open(path)
    await journal.append(1, True, {"x": 1})
    with open(path, "ab") as out:
        out.write(b'{"line": 2, "ok": true, "rec')
    reopened = Journal.open(path)
    assert reopened.answered == {1}
    assert await reopened.append(2, True, {"x": 2})
    assert Journal.open(path).answered == {1, 2}


def test_batch_records_round_trip_and_a_broken_one_is_skipped(tmp_path: Path) -> None:
    record = BatchRecord("batch_" + "a" * 32, "k", "/v1/completions", "file-x", "24h", 10, 20, {"m": "v"})
    record.times["in_progress"] = 11
    (tmp_path / record.batch_id).mkdir()
    save_record(tmp_path, record)
    (tmp_path / ("batch_" + "b" * 32)).mkdir()
    (tmp_path / ("batch_" + "b" * 32) / "batch.json").write_text("{")
    [loaded] = load_records(tmp_path)
    assert loaded == record and loaded.as_json()["in_progress_at"] == 11 and loaded.as_json()["cancelled_at"] is None
