"""Which way each request of a batch goes, checked before any byte moves (no I/O, no state of its own).

1. `route_request` validates one request: its type, op, length and offsets, the remote endpoint's syntax, and the
   bounds of its local segment (GPU memory only when RDMA to another host moves it).
2. Same-host rule (`is_same_host`): a remote segment is local when its endpoint is the engine's own, or its host
   is the engine's host and a segment of that name is registered here (the store's shared memory, mapped); then
   the route carries the remote bytes too and the engine copies them with memcpy. Segment names are therefore
   unique per host, except for such mappings of the same memory.
3. A remote on another host needs a network transport: tcp in the engine's transports, or RDMA active.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mooncaked.transfer.segments import SegmentTable
from mooncaked.transfer.types import SegmentRef, TransferOp, TransferRequest, split_endpoint


@dataclass(frozen=True)
class Route:
    request_index: int
    request: TransferRequest
    local_view: memoryview
    same_host_view: memoryview | None  # the remote segment's bytes when it is on this host


@dataclass(frozen=True)
class RouteContext:
    """What routing reads of the engine at one `submit` (its endpoint is known only after start)."""

    segments: SegmentTable
    endpoint: str
    host: str
    transports: Sequence[str]
    is_rdma_active: bool
    rdma_unavailable_reason: str


def is_device(segments: SegmentTable, segment_name: str) -> bool:
    segment = segments.get(segment_name)
    return segment is not None and segment.is_device


def is_same_host(context: RouteContext, remote: SegmentRef) -> bool:
    if "local" not in context.transports:
        return False
    if remote.endpoint == context.endpoint:
        return True
    host, _ = split_endpoint(remote.endpoint)
    return host == context.host and context.segments.get(remote.name) is not None


def route_request(context: RouteContext, index: int, request: TransferRequest) -> Route:
    """The request's route; ValueError naming the request index and the problem."""
    if not isinstance(request, TransferRequest):
        raise ValueError(f"request {index}: expected a TransferRequest, got {type(request).__name__}")
    if not isinstance(request.op, TransferOp):
        raise ValueError(f"request {index}: op must be TransferOp.READ or TransferOp.WRITE, got {request.op!r}")
    if request.length < 1 or request.local_offset < 0 or request.remote_offset < 0:
        raise ValueError(
            f"request {index}: length must be >= 1 and offsets >= 0, got length={request.length} "
            f"local_offset={request.local_offset} remote_offset={request.remote_offset}"
        )
    segments = context.segments
    try:
        split_endpoint(request.remote.endpoint)
        is_local_device = is_device(segments, request.local_segment)
        if is_local_device and (not context.is_rdma_active or is_same_host(context, request.remote)):
            raise ValueError(f"segment {request.local_segment!r} is GPU memory: only RDMA to another host "
                             "moves it")
        local_view = segments.view(request.local_segment, request.local_offset, request.length,
                                   allow_device=is_local_device)
        same_host_view = None
        if is_same_host(context, request.remote):
            same_host_view = segments.view(request.remote.name, request.remote_offset, request.length)
    except ValueError as exc:
        raise ValueError(f"request {index}: {exc}") from None
    if same_host_view is None and "tcp" not in context.transports and not context.is_rdma_active:
        raise ValueError(
            f"request {index}: {request.remote.endpoint} is another host and no network transport is active "
            f"(tcp is not in transports; rdma: {context.rdma_unavailable_reason or 'not active'})"
        )
    return Route(index, request, local_view, same_host_view)
