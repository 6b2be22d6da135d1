"""Mooncake JSONL traces: one request per line, `timestamp` (ms), `input_length`, `output_length`, `hash_ids`.

`hash_ids` are chained prefix-block ids (512-token blocks): equal ids mean equal prefixes up to that block.
`load_trace(path, speed)` divides timestamps by `speed` (2.0 replays twice as fast) and reports bad lines by
number.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TraceRequest:
    index: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


class TraceError(ValueError):
    """A trace line is not a valid Mooncake request record; the message names the line."""


def load_trace(path: str | Path, speed: float = 1.0, max_requests: int = 0) -> list[TraceRequest]:
    """Requests in file order (the trace is sorted by timestamp); `max_requests` 0 means all."""
    if speed <= 0:
        raise TraceError(f"speed must be positive, got {speed}")
    requests: list[TraceRequest] = []
    with open(path) as lines:
        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            requests.append(_parse_line(line, line_number, len(requests), speed))
            if max_requests and len(requests) >= max_requests:
                break
    return requests


def _parse_line(line: str, line_number: int, index: int, speed: float) -> TraceRequest:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"line {line_number}: not JSON ({exc.msg})") from exc
    if not isinstance(record, dict):
        raise TraceError(f"line {line_number}: expected a JSON object")
    for key in ("timestamp", "input_length", "output_length", "hash_ids"):
        if key not in record:
            raise TraceError(f"line {line_number}: missing {key!r}")
    hash_ids = record["hash_ids"]
    if not isinstance(hash_ids, list) or not all(isinstance(h, int) for h in hash_ids):
        raise TraceError(f"line {line_number}: hash_ids must be a list of integers")
    input_length, output_length = record["input_length"], record["output_length"]
    if not isinstance(input_length, int) or input_length < 1:
        raise TraceError(f"line {line_number}: input_length must be a positive integer")
    if not isinstance(output_length, int) or output_length < 0:
        raise TraceError(f"line {line_number}: output_length must be a non-negative integer")
    timestamp = record["timestamp"]
    if not isinstance(timestamp, (int, float)):
        raise TraceError(f"line {line_number}: timestamp must be a number of milliseconds")
    return TraceRequest(index, timestamp / 1000.0 / speed, input_length, output_length, tuple(hash_ids))
