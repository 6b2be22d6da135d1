"""RDMA transport: NICs, memory regions, the endpoint pool, per-peer links, and the target side of `connect`.

1. Construction opens every NIC of the topology through the verbs provider (RdmaUnavailable when none opens).
2. `register_segment` registers the segment's memory on every NIC (one memory region each; all or none: GPU
   memory where a NIC cannot map it fails as a whole); `unregister_segment` deregisters them.
3. `submit(peer, pieces)` hands pieces to the peer's link (created on first use), which moves them by RDMA.
4. `handle_control` answers peers: `describe` (NICs, topology, segment regions), `connect` (build, connect and
   keep a passive queue pair), `disconnect` (close it).
5. `stop` stops the links, closes every endpoint, deregisters memory and closes the NICs.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from mooncaked.transfer.control import (
    AsyncControlChannel,
    ConnectReply,
    ConnectRequest,
    ControlChannel,
    DescribeReply,
    DescribeRequest,
    DisconnectReply,
    DisconnectRequest,
    QpExchange,
    RegionInfo,
    SegmentInfo,
    TcpControlChannel,
    decode_control,
    encode_control,
)
from mooncaked.transfer.dispatch import Piece
from mooncaked.transfer.endpoints import Endpoint, EndpointKey, EndpointPool
from mooncaked.transfer.handshake import DataCredentials
from mooncaked.transfer.options import TransferOptions
from mooncaked.transfer.paths import PathHealth
from mooncaked.transfer.pyverbs_provider import PyverbsProvider
from mooncaked.transfer.rdma_link import Fallback, LinkServices, RdmaPeerLink
from mooncaked.transfer.segments import DEFAULT_LOCATION, Segment, SegmentTable
from mooncaked.transfer.topology import Topology, discover_topology
from mooncaked.transfer.verbs import RdmaUnavailable, VerbsMemoryRegion, VerbsNic, VerbsProvider, VerbsQueuePair

logger = logging.getLogger(__name__)


class RdmaTransport:
    """Owns the opened NICs, memory regions (segment x NIC), the endpoint pool and the RDMA peer links."""

    def __init__(
        self, options: TransferOptions, *, provider: VerbsProvider, topology: Topology, endpoint: str,
        segments: SegmentTable, control: ControlChannel, fallback: Fallback | None,
    ) -> None:
        self.options = options
        self.endpoint = endpoint
        self.topology = topology
        self._segments = segments
        self._control = control
        self._fallback = fallback
        self._nics = _open_nics(provider, topology.nics)
        self._regions: dict[tuple[str, str], VerbsMemoryRegion] = {}
        self._links: dict[str, RdmaPeerLink] = {}
        self._lock = threading.Lock()
        self.pool = EndpointPool(options.max_endpoints, self._evict)

    @classmethod
    def open(
        cls, options: TransferOptions, *, endpoint: str, segments: SegmentTable, loop: asyncio.AbstractEventLoop,
        verbs: VerbsProvider | None, qp_exchange: QpExchange | None, fallback: Fallback | None,
        credentials: DataCredentials,
    ) -> RdmaTransport:
        """Pick the verbs provider (pyverbs unless given), the topology (sysfs unless given) and the control
        channel (RPC when `qp_exchange` is given, else the peer's data listener); register existing segments."""
        provider = verbs if verbs is not None else PyverbsProvider.load()
        topology = options.topology if options.topology is not None else discover_topology(options.sysfs_root)
        if not topology.nics:
            raise RdmaUnavailable(f"no RDMA NICs in the topology (sysfs root {options.sysfs_root})")
        control: ControlChannel = TcpControlChannel(credentials)
        if qp_exchange is not None:
            control = AsyncControlChannel(qp_exchange, loop)
        transport = cls(
            options, provider=provider, topology=topology, endpoint=endpoint, segments=segments, control=control,
            fallback=fallback,
        )
        for name in segments.names():
            segment = segments.get(name)
            if segment is not None:
                transport.register_segment(segment)
        return transport

    @property
    def nics(self) -> list[str]:
        return list(self._nics)

    def register_segment(self, segment: Segment) -> None:
        regions: dict[tuple[str, str], VerbsMemoryRegion] = {}
        try:
            for name, nic in self._nics.items():
                regions[(segment.name, name)] = nic.register(segment.view, is_device=segment.is_device)
        except OSError:
            for region in regions.values():
                region.close()
            raise
        with self._lock:
            self._regions.update(regions)

    def unregister_segment(self, name: str) -> None:
        with self._lock:
            keys = [key for key in self._regions if key[0] == name]
            regions = [self._regions.pop(key) for key in keys]
        for region in regions:
            region.close()

    def submit(self, peer: str, pieces: list[Piece]) -> None:
        with self._lock:
            link = self._links.get(peer)
            if link is None:
                options = self.options
                link = RdmaPeerLink(
                    peer, self._services(), slice_bytes=options.slice_bytes,
                    health=PathHealth(options.path_failure_threshold, options.path_cooldown_s),
                    max_retries=options.max_retries, io_timeout_s=options.io_timeout_s,
                )
                link.start()
                self._links[peer] = link
        link.submit(pieces)

    def link(self, peer: str) -> RdmaPeerLink | None:
        return self._links.get(peer)

    def stop(self, timeout_s: float) -> None:
        with self._lock:
            links = list(self._links.values())
            self._links.clear()
        deadline = time.monotonic() + timeout_s
        for link in links:
            link.stop(max(deadline - time.monotonic(), 0.0))
        self.pool.close_all()
        with self._lock:
            regions = list(self._regions.values())
            self._regions.clear()
        for region in regions:
            region.close()
        for nic in self._nics.values():
            nic.close()

    def handle_control(self, payload: bytes) -> bytes:
        """Answer one control message from a peer; ValueError on a malformed or unserviceable one."""
        message = decode_control(payload)
        if isinstance(message, DescribeRequest):
            return encode_control(self._describe(message))
        if isinstance(message, ConnectRequest):
            return encode_control(self._accept(message))
        if isinstance(message, DisconnectRequest):
            key = EndpointKey(False, message.initiator, message.target_nic, message.initiator_nic)
            return encode_control(DisconnectReply(self.pool.close_passive(key)))
        raise ValueError(f"unexpected control message {type(message).__name__}")

    def _describe(self, request: DescribeRequest) -> DescribeReply:
        segments = {}
        with self._lock:
            for name in request.names:
                segment = self._segments.get(name)
                if segment is None:
                    continue
                regions = {
                    nic: RegionInfo(region.addr, region.rkey)
                    for (seg, nic), region in self._regions.items()
                    if seg == name
                }
                segments[name] = SegmentInfo(segment.location, segment.num_bytes, regions)
        return DescribeReply(self.nics, self.topology.to_config(), segments)

    def _accept(self, request: ConnectRequest) -> ConnectReply:
        nic = self._nics.get(request.target_nic)
        if nic is None:
            raise ValueError(f"this engine has no NIC {request.target_nic!r}")
        qp = nic.create_qp(self.options.rdma_max_send_wr)
        qp.connect(request.qp)
        self.pool.put_passive(EndpointKey(False, request.initiator, request.target_nic, request.qp.nic), qp)
        return ConnectReply(qp.info())

    def _connect(self, peer: str, local_nic: str, remote_nic: str) -> VerbsQueuePair:
        qp = self._nics[local_nic].create_qp(self.options.rdma_max_send_wr)
        try:
            request = encode_control(ConnectRequest(self.endpoint, remote_nic, qp.info()))
            reply = decode_control(self._control.exchange(peer, request, self.options.io_timeout_s))
            if not isinstance(reply, ConnectReply):
                raise ValueError(f"expected a connect reply, got {type(reply).__name__}")
            qp.connect(reply.qp)
        except BaseException:
            qp.close()
            raise
        return qp

    def _evict(self, endpoint: Endpoint) -> None:
        endpoint.qp.close()
        if not endpoint.key.is_active:
            return
        message = DisconnectRequest(self.endpoint, endpoint.key.local_nic, endpoint.key.remote_nic)
        try:
            self._control.exchange(endpoint.key.peer, encode_control(message), self.options.io_timeout_s)
        except (OSError, ValueError) as exc:
            logger.debug("disconnect of %s not delivered: %s", endpoint.key, exc)

    def _services(self) -> LinkServices:
        return LinkServices(
            local_topology=self.topology, local_nics=self.nics, local_location=self._location,
            local_region=self._region, connect=self._connect, pool=self.pool, control=self._control,
            fallback=self._fallback,
        )

    def _location(self, segment_name: str) -> str:
        segment = self._segments.get(segment_name)
        return DEFAULT_LOCATION if segment is None else segment.location

    def _region(self, segment_name: str, nic: str) -> tuple[int, int] | None:
        with self._lock:
            region = self._regions.get((segment_name, nic))
        return None if region is None else (region.addr, region.lkey)


def _open_nics(provider: VerbsProvider, names: list[str]) -> dict[str, VerbsNic]:
    nics: dict[str, VerbsNic] = {}
    problems = []
    for name in names:
        try:
            nics[name] = provider.open_nic(name)
        except (OSError, RdmaUnavailable) as exc:
            problems.append(f"{name}: {exc}")
    if not nics:
        detail = "; ".join(problems) if problems else "the topology lists no NICs"
        raise RdmaUnavailable(f"no RDMA NIC could be opened ({detail})")
    if problems:
        logger.warning("some RDMA NICs are unusable: %s", "; ".join(problems))
    return nics
