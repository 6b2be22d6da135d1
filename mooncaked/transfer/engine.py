"""The transfer engine (the paper's Listing 1): register memory, submit batches, poll or await them.

1. `start` binds the data listener (its "host:port" is `endpoint`) and captures the event loop. Every data
   connection, both ways, starts with the handshake of handshake.py under this engine's `cluster_id` and, when
   given, its `secret`: a peer without them reads and writes nothing here.
2. `register(name, buffer, location)` makes memory addressable as `SegmentRef(endpoint, name)`;
   `register_device(name, address, num_bytes, "cuda:N")` does so for GPU memory when RDMA is active and every
   NIC can map it (GPUDirect), else raises: the caller then stages through pinned host memory.
3. `submit(requests)` validates every request (bounds of local and same-host segments, known segments, endpoint
   syntax), then routes each one (routing.py): `local` (memcpy) when the remote segment is on this host, else
   `tcp` (or `rdma` when enabled and available), cut into slices spread over the peer's paths (with `nics`, the
   connections over every NIC pair of the two hosts: tcp_client.py). It returns a batch id.
4. `status(batch_id)` reports progress; `await wait(batch_id, timeout_s)` returns when every byte moved, raises
   TransferError on failure or deadline, and forgets the batch.
5. `stop` refuses new batches, drains pending ones for up to `drain_timeout_s`, fails the rest, then stops the
   peer links, the listener and the copy threads within `stop_timeout_s` each.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from typing import Any

from mooncaked.transfer.batch import BatchTable
from mooncaked.transfer.control import DescribeReply, DescribeRequest, QpExchange, decode_control, encode_control
from mooncaked.transfer.dispatch import Piece, run_bytes_for
from mooncaked.transfer.handshake import DataCredentials
from mooncaked.transfer.local import LocalTransport
from mooncaked.transfer.nics import Nic
from mooncaked.transfer.options import TransferOptions
from mooncaked.transfer.rdma_transport import RdmaTransport
from mooncaked.transfer.routing import RouteContext, is_device, route_request
from mooncaked.transfer.segments import DEFAULT_LOCATION, Segment, SegmentTable
from mooncaked.transfer.tcp_client import TcpPeerLink
from mooncaked.transfer.tcp_server import DataServer
from mooncaked.transfer.topology import Topology
from mooncaked.transfer.types import BatchState, BatchStatus, SegmentRef, TransferError, TransferOp, TransferRequest
from mooncaked.transfer.verbs import RdmaUnavailable, VerbsProvider

logger = logging.getLogger(__name__)


class TransferEngine:
    """Owns its segments, batches, data listener, peer links (one per remote endpoint) and local copier."""

    def __init__(
        self,
        *,
        host: str,
        port: int = 0,
        transports: Sequence[str] = ("local", "tcp"),
        slice_bytes: int = 64 * 1024,
        num_connections_per_peer: int = 4,
        max_retries: int = 3,
        path_cooldown_s: float = 5.0,
        topology: Topology | None = None,
        path_failure_threshold: int = 2,
        tcp_frame_bytes: int = 16 << 20,
        tcp_send_buffer_bytes: int = 256 << 10,
        connect_timeout_s: float = 2.0,
        io_timeout_s: float = 10.0,
        idle_timeout_s: float = 300.0,
        stop_timeout_s: float = 5.0,
        sysfs_root: str = "/sys",
        max_endpoints: int = 256,
        rdma_slices_per_run: int = 16,
        verbs: VerbsProvider | None = None,
        qp_exchange: QpExchange | None = None,
        cluster_id: str = "",
        secret: bytes | None = None,
        nics: Sequence[Nic] = (),
    ) -> None:
        """Options as in TransferOptions; `verbs` replaces pyverbs (tests pass a fake); `qp_exchange` carries
        RDMA control messages over RPC instead of this engine's data listener; `cluster_id` and `secret` are
        what the data handshake checks (peers must have the same); `nics`: this host's NICs (nics.py), listened on
        and striped over by TCP transfers."""
        self.options = TransferOptions(
            transports=tuple(transports), slice_bytes=slice_bytes, num_connections_per_peer=num_connections_per_peer,
            max_retries=max_retries, path_cooldown_s=path_cooldown_s, topology=topology,
            path_failure_threshold=path_failure_threshold, tcp_frame_bytes=tcp_frame_bytes,
            tcp_send_buffer_bytes=tcp_send_buffer_bytes,
            connect_timeout_s=connect_timeout_s, io_timeout_s=io_timeout_s, idle_timeout_s=idle_timeout_s,
            stop_timeout_s=stop_timeout_s,
            sysfs_root=sysfs_root, max_endpoints=max_endpoints, rdma_slices_per_run=rdma_slices_per_run,
            rdma_max_send_wr=max(64, rdma_slices_per_run), nics=tuple(nics),
        )
        self.host = host
        self.transports = self.options.transports
        self.rdma_unavailable_reason = "" if "rdma" in transports else "rdma is not in transports"
        self._verbs = verbs
        self._qp_exchange = qp_exchange
        self._port = port
        self._credentials = DataCredentials(cluster_id, secret)
        self._segments = SegmentTable()
        self._batches = BatchTable()
        self._server = DataServer(
            host, port, self._segments, lambda payload: self.handle_control(payload).decode(),
            credentials=self._credentials, handshake_timeout_s=connect_timeout_s, io_timeout_s=io_timeout_s,
            idle_timeout_s=idle_timeout_s, send_buffer_bytes=tcp_send_buffer_bytes, nics=nics,
        )
        self._links: dict[str, TcpPeerLink] = {}
        self._links_lock = threading.Lock()
        self._rdma: RdmaTransport | None = None
        self._local = LocalTransport()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._is_stopping = False

    @property
    def endpoint(self) -> str:
        if self._port == 0:
            raise RuntimeError("the engine's port is chosen at start(); call `await engine.start()` first")
        return f"{self.host}:{self._port}"

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._port = self._server.start()
        if "rdma" in self.transports:
            try:
                self._rdma = RdmaTransport.open(
                    self.options, endpoint=self.endpoint, segments=self._segments, loop=self._loop,
                    verbs=self._verbs, qp_exchange=self._qp_exchange,
                    fallback=self._tcp_fallback if "tcp" in self.transports else None,
                    credentials=self._credentials,
                )
            except RdmaUnavailable as exc:
                self.rdma_unavailable_reason = str(exc)
                logger.warning("rdma transport unavailable on %s: %s", self.endpoint, exc)
        logger.info("transfer engine listening on %s (transports %s)", self.endpoint, ",".join(self.transports))

    async def stop(self, drain_timeout_s: float = 0.0) -> None:
        """Refuse new batches, let pending ones finish for up to `drain_timeout_s`, fail the rest, release all."""
        self._is_stopping = True
        pending = [asyncio.ensure_future(event.wait()) for event in self._batches.pending_events()]
        if pending:
            _, unfinished = await asyncio.wait(pending, timeout=max(drain_timeout_s, 0.0))
            for task in unfinished:
                task.cancel()
        self._batches.fail_all("transfer engine stopped")
        if self._rdma is not None:
            await asyncio.to_thread(self._rdma.stop, self.options.stop_timeout_s)
            self._rdma = None
        with self._links_lock:
            links = list(self._links.values())
            self._links.clear()
        for link in links:
            await asyncio.to_thread(link.stop, self.options.stop_timeout_s)
        await asyncio.to_thread(self._server.stop, self.options.stop_timeout_s)
        await asyncio.to_thread(self._local.stop)

    def register(self, name: str, buffer: Any, location: str = DEFAULT_LOCATION) -> SegmentRef:
        """Make `buffer` addressable by peers as SegmentRef(self.endpoint, name)."""
        segment = self._segments.register(name, buffer, location)
        if self._rdma is not None:
            self._register_with_rdma(segment, name)
        return SegmentRef(self.endpoint, name)

    def register_device(self, name: str, address: int, num_bytes: int, location: str, owner: Any) -> SegmentRef:
        """GPU memory as a segment that only RDMA moves; ValueError without RDMA, OSError when a NIC cannot map
        it (no GPUDirect)."""
        if self._rdma is None:
            raise ValueError(f"GPU memory moves only by RDMA, which is not active here "
                             f"({self.rdma_unavailable_reason or 'no NIC'})")
        segment = self._segments.register_device(name, address, num_bytes, location, owner)
        self._register_with_rdma(segment, name)
        return SegmentRef(self.endpoint, name)

    def _register_with_rdma(self, segment: Segment, name: str) -> None:
        """Map `segment` on the NICs; a NIC that refuses leaves the segment unregistered everywhere."""
        assert self._rdma is not None
        try:
            self._rdma.register_segment(segment)
        except OSError:
            self._segments.unregister(name)
            raise

    def unregister(self, name: str) -> None:
        self._segments.unregister(name)
        if self._rdma is not None:
            self._rdma.unregister_segment(name)

    @property
    def rdma(self) -> RdmaTransport | None:
        """The active RDMA transport, or None (see `rdma_unavailable_reason`)."""
        return self._rdma

    def handle_control(self, payload: bytes) -> bytes:
        """Answer a peer's RDMA control message (the RPC layer may route QP exchange here)."""
        if self._rdma is not None:
            return self._rdma.handle_control(payload)
        if isinstance(decode_control(payload), DescribeRequest):
            return encode_control(DescribeReply([], {}))  # no NICs: initiators fall back to tcp
        raise ValueError(f"rdma is not active at {self.endpoint}: {self.rdma_unavailable_reason}")

    def segment_location(self, name: str) -> str | None:
        """Where a registered segment's memory is ("cpu:N", "cuda:N"); None when `name` is not registered."""
        segment = self._segments.get(name)
        return None if segment is None else segment.location

    def path_states(self, endpoint: str) -> dict[str, bool]:
        """Every path this engine has used towards `endpoint`, and whether it is usable now (not cooling down)."""
        states = {}
        rdma_link = self._rdma.link(endpoint) if self._rdma is not None else None
        if rdma_link is not None and rdma_link.queue is not None:
            states.update(rdma_link.queue.path_states())
        with self._links_lock:
            tcp_link = self._links.get(endpoint)
        if tcp_link is not None:
            states.update(tcp_link.queue.path_states())
        return states

    def submit(self, requests: Sequence[TransferRequest]) -> int:
        """Validate and start a batch; ValueError naming the request index and the problem."""
        if self._loop is None or self._is_stopping:
            raise RuntimeError("the engine is not running: call `await engine.start()` first (and not after stop())")
        context = RouteContext(self._segments, self.endpoint, self.host, self.transports, self._rdma is not None,
                               self.rdma_unavailable_reason)
        routes = [route_request(context, index, request) for index, request in enumerate(requests)]
        record = self._batches.create(sum(route.request.length for route in routes), self._loop)
        pieces_by_peer: dict[str, list[Piece]] = {}
        for route in routes:
            request = route.request
            if route.same_host_view is not None:
                dst, src = route.local_view, route.same_host_view
                if request.op is TransferOp.WRITE:
                    dst, src = src, dst
                self._local.copy(record, route.request_index, dst, src)
                continue
            piece = Piece(
                record, route.request_index, request.op, route.local_view, request.remote.name,
                request.remote_offset, request.length, self._run_bytes(request.length),
                local_segment=request.local_segment,
                location=self.segment_location(request.local_segment) or "",
            )
            pieces_by_peer.setdefault(request.remote.endpoint, []).append(piece)
        for endpoint, pieces in pieces_by_peer.items():
            if self._rdma is not None:
                self._rdma.submit(endpoint, pieces)
            else:
                self._link(endpoint).queue.put(pieces)
        return record.batch_id

    def _run_bytes(self, length: int) -> int:
        options = self.options
        if self._rdma is not None:
            max_run = options.slice_bytes * options.rdma_slices_per_run
            return run_bytes_for(length, options.slice_bytes, len(self._rdma.nics), max_run)
        return run_bytes_for(length, options.slice_bytes, options.num_connections_per_peer, options.tcp_frame_bytes)

    def status(self, batch_id: int) -> BatchStatus:
        return self._batches.get(batch_id).status()

    async def wait(self, batch_id: int, timeout_s: float) -> None:
        """Return when the batch is done; TransferError on failure or after `timeout_s`. Forgets the batch."""
        record = self._batches.get(batch_id)
        try:
            await asyncio.wait_for(record.finished.wait(), timeout_s)
        except asyncio.TimeoutError:
            record.fail(
                f"deadline of {timeout_s:g}s exceeded with {record.num_bytes_done} of "
                f"{record.num_bytes_total} bytes done"
            )
        finally:
            record.fail("wait() was cancelled")
            self._batches.pop(batch_id)
        if record.state is BatchState.FAILED:
            raise TransferError(record.error)

    def _tcp_fallback(self, endpoint: str, pieces: list[Piece]) -> None:
        """A peer without RDMA: its pieces go over tcp (called from the rdma intake thread); GPU memory cannot."""
        device = [piece for piece in pieces if is_device(self._segments, piece.local_segment)]
        for piece in device:
            piece.batch.fail(f"request {piece.request_index}: {endpoint} has no RDMA, and segment "
                             f"{piece.local_segment!r} is GPU memory (stage it through host memory)")
        if len(device) < len(pieces):
            self._link(endpoint).queue.put([piece for piece in pieces if piece not in device])

    def _link(self, endpoint: str) -> TcpPeerLink:
        with self._links_lock:
            return self._link_locked(endpoint)

    def _link_locked(self, endpoint: str) -> TcpPeerLink:
        link = self._links.get(endpoint)
        if link is None:
            link = TcpPeerLink(endpoint, self.options, self._credentials)
            link.start()
            self._links[endpoint] = link
        return link
