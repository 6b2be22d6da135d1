"""RDMA transport, one peer: describe the peer, rank paths by topology, drive one worker per NIC pair.

1. `submit` hands pieces to the intake thread, which asks the peer (once per segment name) for its NICs,
   topology and segment regions, ranks each piece's paths (local NIC x remote NIC) by the topology tier of the
   local and remote memory locations, and queues it. A peer without NICs gets its pieces handed to `fallback`.
2. Each path worker takes a run of slices, acquires the endpoint (building the queue pair on first use), posts
   one RDMA READ/WRITE per slice, and polls completions on its own thread within `io_timeout_s`.
3. A failed completion discards the endpoint (rebuilt on next use), marks the remote segment's description stale
   (described again before its next use: the peer may have re-registered it or restarted) and hands the run
   back for another path.
4. `stop` closes the queue and joins the threads within a deadline.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from mooncaked.transfer.control import (
    ControlChannel,
    DescribeReply,
    DescribeRequest,
    RegionInfo,
    SegmentInfo,
    decode_control,
    encode_control,
)
from mooncaked.transfer.dispatch import PeerQueue, Piece
from mooncaked.transfer.endpoints import Endpoint, EndpointKey, EndpointPool
from mooncaked.transfer.paths import PathHealth
from mooncaked.transfer.topology import Topology
from mooncaked.transfer.verbs import Completion, VerbsQueuePair, WorkRequest, buffer_address

_POLL_S = 0.25
Fallback = Callable[[str, list[Piece]], None]


@dataclass(frozen=True)
class LinkServices:
    """What a link borrows from its transport (the transport owns all of it)."""

    local_topology: Topology
    local_nics: list[str]
    local_location: Callable[[str], str]  # segment name -> "cpu:N"
    local_region: Callable[[str, str], tuple[int, int] | None]  # (segment, nic) -> (addr, lkey)
    connect: Callable[[str, str, str], VerbsQueuePair]  # (peer, local nic, remote nic) -> connected qp
    pool: EndpointPool
    control: ControlChannel
    fallback: Fallback | None


class RdmaPeerLink:
    """Owns one peer's description cache, PeerQueue, intake thread and path worker threads."""

    def __init__(
        self, peer: str, services: LinkServices, *, slice_bytes: int, health: PathHealth, max_retries: int,
        io_timeout_s: float,
    ) -> None:
        self.peer = peer
        self._services = services
        self._slice_bytes = slice_bytes
        self._health = health
        self._max_retries = max_retries
        self._io_timeout_s = io_timeout_s
        self._intake: queue.Queue[list[Piece]] = queue.Queue()
        self._segments: dict[str, SegmentInfo] = {}  # written under _describe_lock
        self._stale: set[str] = set()  # segment names whose regions failed: describe again before use
        self._describe_lock = threading.Lock()
        self._remote: DescribeReply | None = None
        self.queue: PeerQueue | None = None
        self._is_stopping = threading.Event()
        self._threads = [threading.Thread(target=self._run_intake, name=f"rdma-intake-{peer}", daemon=True)]
        self._wr_ids = itertools.count(1)

    def start(self) -> None:
        self._threads[0].start()

    def submit(self, pieces: list[Piece]) -> None:
        self._intake.put(pieces)

    def stop(self, timeout_s: float) -> None:
        self._is_stopping.set()
        self._intake.put([])  # wakes the intake thread
        if self.queue is not None:
            self.queue.close(f"transfer engine stopped; rdma link to {self.peer} closed")
        deadline = time.monotonic() + timeout_s
        for thread in list(self._threads):
            thread.join(max(deadline - time.monotonic(), 0.0))
        while not self._intake.empty():
            for piece in self._intake.get_nowait():
                piece.batch.fail("transfer engine stopped")

    def _run_intake(self) -> None:
        while not self._is_stopping.is_set():
            try:
                pieces = self._intake.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if not pieces:
                continue
            try:
                self._describe([p.remote_name for p in pieces if p.remote_name not in self._segments])
            except (OSError, ValueError) as exc:
                for piece in pieces:
                    piece.batch.fail(f"request {piece.request_index}: cannot describe {self.peer} for rdma: {exc}")
                continue
            self._route(pieces)

    def _describe(self, names: list[str]) -> None:
        with self._describe_lock:
            if self._remote is not None and not names:
                return
            request = encode_control(DescribeRequest(sorted(set(names))))
            reply = decode_control(self._services.control.exchange(self.peer, request, self._io_timeout_s))
            if not isinstance(reply, DescribeReply):
                raise ValueError(f"expected a describe reply, got {type(reply).__name__}")
            for name in names:
                self._stale.discard(name)
                self._segments.pop(name, None)
            self._segments.update(reply.segments)
            if self._remote is None:
                self._remote = reply
                self._start_workers(reply)

    def _start_workers(self, remote: DescribeReply) -> None:
        paths = [f"rdma:{self.peer}:{l}>{r}" for l in self._services.local_nics for r in remote.nics]
        self.queue = PeerQueue(self.peer, paths, self._health, self._max_retries)
        for local_nic in self._services.local_nics:
            for remote_nic in remote.nics:
                path = f"rdma:{self.peer}:{local_nic}>{remote_nic}"
                thread = threading.Thread(
                    target=self._run_worker, args=(path, local_nic, remote_nic), name=path, daemon=True
                )
                self._threads.append(thread)
                thread.start()

    def _route(self, pieces: list[Piece]) -> None:
        assert self._remote is not None and self.queue is not None
        if not self._remote.nics:
            if self._services.fallback is not None:
                self._services.fallback(self.peer, pieces)
                return
            for piece in pieces:
                piece.batch.fail(f"request {piece.request_index}: {self.peer} has no RDMA NICs and tcp is off")
            return
        remote_topology = Topology.from_config(self._remote.topology)
        routed = []
        for piece in pieces:
            segment = self._segments.get(piece.remote_name)
            if segment is None:
                missing = f"segment {piece.remote_name!r} is not registered at {self.peer}"
                piece.batch.fail(f"request {piece.request_index}: {missing}")
                continue
            local_location = self._services.local_location(piece.local_segment)
            piece.path_tiers = {
                f"rdma:{self.peer}:{l}>{r}": self._services.local_topology.tier(local_location, l)
                + remote_topology.tier(segment.location, r)
                for l in self._services.local_nics
                for r in self._remote.nics
            }
            routed.append(piece)
        self.queue.put(routed)

    def _run_worker(self, path: str, local_nic: str, remote_nic: str) -> None:
        assert self.queue is not None
        key = EndpointKey(True, self.peer, local_nic, remote_nic)
        while not self._is_stopping.is_set():
            piece = self.queue.take(path, _POLL_S)
            if piece is None:
                continue
            try:
                segment, problem = self._checked_segment(piece, local_nic, remote_nic)
            except (OSError, ValueError) as exc:
                self.queue.retry(path, piece, f"{path}: describing {self.peer} failed: {exc}")
                continue
            if segment is None or problem:
                self.queue.reject(piece, problem)
                continue
            try:
                endpoint = self._services.pool.acquire(
                    key, lambda: self._services.connect(self.peer, local_nic, remote_nic)
                )
            except (OSError, ValueError) as exc:
                self.queue.retry(path, piece, f"{path}: connect failed: {exc}")
                continue
            self._execute(path, endpoint, piece, local_nic, segment.regions[remote_nic])

    def _checked_segment(self, piece: Piece, local_nic: str, remote_nic: str) -> tuple[SegmentInfo | None, str]:
        """The remote segment's description and what is wrong with the piece against it ("" if nothing). A stale
        or refusing cached description is fetched again first: the peer may have re-registered it or restarted."""
        is_fresh = False
        if piece.remote_name in self._stale:
            self._describe([piece.remote_name])
            is_fresh = True
        segment = self._segments.get(piece.remote_name)
        problem = self._check(piece, segment, local_nic, remote_nic)
        if problem and not is_fresh:
            self._describe([piece.remote_name])
            segment = self._segments.get(piece.remote_name)
            problem = self._check(piece, segment, local_nic, remote_nic)
        return segment, problem

    def _check(self, piece: Piece, segment: SegmentInfo | None, local_nic: str, remote_nic: str) -> str:
        if segment is None:
            return f"segment {piece.remote_name!r} is not registered at {self.peer}"
        end = piece.remote_offset + piece.length
        if end > segment.length:
            return (
                f"range [{piece.remote_offset}, {end}) is outside segment {piece.remote_name!r} "
                f"of {segment.length} bytes at {self.peer}"
            )
        if self._services.local_region(piece.local_segment, local_nic) is None:
            return f"local segment {piece.local_segment!r} is not registered with NIC {local_nic}"
        if remote_nic not in segment.regions:
            return f"segment {piece.remote_name!r} at {self.peer} is not registered with NIC {remote_nic}"
        return ""

    def _execute(self, path: str, endpoint: Endpoint, piece: Piece, local_nic: str, remote: RegionInfo) -> None:
        assert self.queue is not None
        region = self._services.local_region(piece.local_segment, local_nic)
        assert region is not None
        local_addr = buffer_address(piece.local_view)
        requests = [
            WorkRequest(
                next(self._wr_ids), piece.op, local_addr + offset, min(self._slice_bytes, piece.length - offset),
                region[1], remote.addr + piece.remote_offset + offset, remote.rkey,
            )
            for offset in range(0, piece.length, self._slice_bytes)
        ]
        try:
            endpoint.qp.post(requests)
            failure = self._await_completions(endpoint.qp, {r.wr_id for r in requests})
        except OSError as exc:
            failure = f"{type(exc).__name__}: {exc}"
        if failure:
            self._stale.add(piece.remote_name)
            self._services.pool.discard(endpoint)
            self.queue.retry(path, piece, f"{path}: {failure}")
            return
        self._services.pool.release(endpoint)
        self.queue.succeed(path, piece)

    def _await_completions(self, qp: VerbsQueuePair, wr_ids: set[int]) -> str:
        """"" when every work request completed fine, else what went wrong."""
        deadline = time.monotonic() + self._io_timeout_s
        backoff_s = 0.0
        while wr_ids:
            completions: list[Completion] = qp.poll(64)
            for completion in completions:
                wr_ids.discard(completion.wr_id)
                if not completion.is_ok:
                    return f"work request failed: {completion.status}"
            if completions:
                backoff_s = 0.0
                continue
            if time.monotonic() > deadline:
                return f"{len(wr_ids)} work requests not completed within {self._io_timeout_s:g}s"
            time.sleep(backoff_s)
            backoff_s = min(backoff_s * 2 or 20e-6, 1e-3)
        return ""
