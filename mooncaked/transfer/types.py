"""Public value types of the transfer engine: requests, segment references, batch status, errors.

1. A caller registers memory as a named segment; peers address it as `SegmentRef(endpoint, name)`.
2. A batch is a sequence of `TransferRequest`s; `READ` copies remote bytes into the local segment,
   `WRITE` copies local bytes into the remote segment.
3. The engine reports a batch as `PENDING`, then `DONE` or `FAILED` (with an error message).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class TransferOp(enum.Enum):
    READ = "read"
    WRITE = "write"


@dataclass(frozen=True)
class SegmentRef:
    """A segment registered at one engine: `endpoint` is "host:port" of that engine's data listener."""

    endpoint: str
    name: str


@dataclass(frozen=True)
class TransferRequest:
    op: TransferOp
    local_segment: str
    local_offset: int
    remote: SegmentRef
    remote_offset: int
    length: int


class BatchState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass
class BatchStatus:
    state: BatchState
    num_bytes_done: int
    error: str | None = None
    num_bytes_total: int = 0


class TransferError(Exception):
    """A batch failed (peer gone, remote rejected a slice, retries exhausted) or missed its deadline."""


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """"host:port" -> (host, port); a clear ValueError otherwise."""
    host, sep, port_text = endpoint.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"endpoint must look like 'host:port', got {endpoint!r}")
    return host, int(port_text)
