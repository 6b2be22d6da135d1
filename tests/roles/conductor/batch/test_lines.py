"""Batch input lines validated up front (roles/conductor/batch/lines.py): every line answered once, valid or not, with
its number."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from mooncaked.api.requests import ChatRequest
from mooncaked.roles.conductor.batch.lines import BatchLine, LineError, error_line, parse_input

MODELS = ["tiny"]


def line(custom_id: object = "a", url: str = "/v1/chat/completions", **body: object) -> bytes:
    payload = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": payload}).encode()


def parse(data: bytes) -> list[BatchLine | LineError]:
    return parse_input(data, batch_id="batch_x", endpoint="/v1/chat/completions", model_ids=MODELS, client_id="k")


def test_valid_lines_become_batch_class_requests_with_their_numbers() -> None:
    [first, second] = parse(line("a", priority=3) + b"\n\n" + line("b") + b"\n")
    assert isinstance(first, BatchLine) and isinstance(second, BatchLine)
    assert (first.number, second.number, first.custom_id) == (1, 3, "a")
    assert isinstance(first.request, ChatRequest) and first.request.is_batch and first.request.priority == 3
    assert first.request.client_id == "k" and first.request.request_id == "batch_x-1"


def test_each_bad_line_names_what_is_wrong() -> None:
    data = b"\n".join([line("a"), line("a"), line(7), line("c", url="/v1/completions"), line("d", stream=True),
                       line("e", model="gpt-9"), line("f", max_tokens=0), b"[1]", b"\xff\xfe"])
    results = parse(data)
    assert isinstance(results[0], BatchLine)
    errors = [(r.number, r.code, r.param) for r in results[1:] if isinstance(r, LineError)]
    assert errors == [(2, "duplicate_custom_id", "custom_id"), (3, "invalid_request", "custom_id"),
                      (4, "invalid_request", "url"), (5, "invalid_request", "body.stream"),
                      (6, "model_not_found", "body.model"), (7, "invalid_request", "body.max_tokens"),
                      (8, "invalid_request", None), (9, "invalid_json", None)]
    assert error_line(results[3])["error"]["line"] == 4  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.binary(max_size=60), st.builds(line, st.one_of(st.text(max_size=5), st.integers()),
                                                             max_tokens=st.one_of(st.integers(-2, 5), st.text()))),
                max_size=8))
def test_hostile_files_answer_every_non_blank_line_exactly_once(raw_lines: list[bytes]) -> None:
    data = b"\n".join(raw.replace(b"\n", b" ") for raw in raw_lines)
    numbers = [n for n, raw in enumerate(data.split(b"\n"), start=1) if raw.strip()]
    results = parse(data)
    assert [r.number for r in results] == numbers
    for result in results:
        if isinstance(result, LineError):
            assert result.message.startswith(f"line {result.number}")
            json.dumps(error_line(result))
