"""RDMA control messages (segment descriptions, queue-pair exchange) and the channels that carry them.

1. An initiator asks a peer to `describe` segments (location, length, per-NIC address and rkey) and its NICs.
2. To open an endpoint it sends `connect` with its QpInfo and the target NIC; the peer creates, connects and
   keeps its own queue pair and answers with its QpInfo. `disconnect` closes the peer's side (eviction, error).
3. Messages are versioned JSON objects. A `ControlChannel` carries them: over the peer's data listener
   (`TcpControlChannel`, an OP_CONTROL frame after the data handshake, so queue-pair information and remote keys
   go only to a peer that proved the cluster secret when one is configured) or over the RPC layer
   (`AsyncControlChannel` wrapping a `QpExchange` coroutine function, called from transport threads; RPC
   connections run their own handshake).
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from mooncaked.transfer import wire
from mooncaked.transfer.handshake import DataCredentials, client_handshake
from mooncaked.transfer.types import split_endpoint
from mooncaked.transfer.verbs import QpInfo

QpExchange = Callable[[str, bytes], Awaitable[bytes]]  # (peer endpoint, request payload) -> reply payload
VERSION = 1


@dataclass(frozen=True)
class RegionInfo:
    addr: int
    rkey: int


@dataclass(frozen=True)
class SegmentInfo:
    location: str
    length: int
    regions: dict[str, RegionInfo]  # by NIC name


@dataclass(frozen=True)
class DescribeRequest:
    KIND: ClassVar[str] = "describe"
    names: list[str]


@dataclass(frozen=True)
class DescribeReply:
    KIND: ClassVar[str] = "describe_reply"
    nics: list[str]
    topology: dict[str, dict[str, list[str]]]
    segments: dict[str, SegmentInfo] = field(default_factory=dict)


@dataclass(frozen=True)
class ConnectRequest:
    KIND: ClassVar[str] = "connect"
    initiator: str  # endpoint of the initiating engine
    target_nic: str
    qp: QpInfo


@dataclass(frozen=True)
class ConnectReply:
    KIND: ClassVar[str] = "connect_reply"
    qp: QpInfo


@dataclass(frozen=True)
class DisconnectRequest:
    KIND: ClassVar[str] = "disconnect"
    initiator: str
    initiator_nic: str
    target_nic: str


@dataclass(frozen=True)
class DisconnectReply:
    KIND: ClassVar[str] = "disconnect_reply"
    was_connected: bool


ControlMessage = DescribeRequest | DescribeReply | ConnectRequest | ConnectReply | DisconnectRequest | DisconnectReply
_TYPES: dict[str, type[Any]] = {
    cls.KIND: cls
    for cls in (DescribeRequest, DescribeReply, ConnectRequest, ConnectReply, DisconnectRequest, DisconnectReply)
}


def encode_control(message: ControlMessage) -> bytes:
    body = {k: _plain(v) for k, v in message.__dict__.items()}
    return json.dumps({"v": VERSION, "kind": message.KIND, "body": body}).encode()


def decode_control(payload: bytes) -> ControlMessage:
    try:
        data = json.loads(payload)
        kind, body = data["kind"], data["body"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"malformed control message: {exc}") from None
    if data.get("v") != VERSION:
        raise ValueError(f"control message version {data.get('v')!r} is not {VERSION}")
    cls = _TYPES.get(kind)
    if cls is None:
        raise ValueError(f"unknown control message kind {kind!r}")
    if "qp" in body:
        body["qp"] = QpInfo.from_dict(body["qp"])
    if cls is DescribeReply:
        body["segments"] = {
            name: SegmentInfo(s["location"], s["length"], {nic: RegionInfo(*r) for nic, r in s["regions"].items()})
            for name, s in body["segments"].items()
        }
    message: ControlMessage = cls(**body)
    return message


def _plain(value: Any) -> Any:
    if isinstance(value, QpInfo):
        return value.to_dict()
    if isinstance(value, SegmentInfo):
        regions = {nic: [r.addr, r.rkey] for nic, r in value.regions.items()}
        return {"location": value.location, "length": value.length, "regions": regions}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


class ControlChannel(Protocol):
    def exchange(self, endpoint: str, payload: bytes, timeout_s: float) -> bytes: ...


class TcpControlChannel:
    """Sends each control message as one OP_CONTROL frame on a short-lived, authenticated connection to the
    peer's listener."""

    def __init__(self, credentials: DataCredentials) -> None:
        self._credentials = credentials

    def exchange(self, endpoint: str, payload: bytes, timeout_s: float) -> bytes:
        with socket.create_connection(split_endpoint(endpoint), timeout=timeout_s) as sock:
            wire.set_io_timeout(sock, timeout_s)
            client_handshake(sock, self._credentials, endpoint)
            sock.sendall(wire.REQUEST.pack(wire.WIRE_VERSION, wire.OP_CONTROL, 0, 0, 1, 0, len(payload)) + payload)
            status, message = wire.recv_reply(sock, 1)
        if status != wire.STATUS_OK:
            raise ConnectionError(f"{endpoint} refused a control message: {message}")
        return message.encode()


class AsyncControlChannel:
    """Runs an async QpExchange (e.g. an RPC call) on the engine's loop from a transport thread."""

    def __init__(self, exchange: QpExchange, loop: asyncio.AbstractEventLoop) -> None:
        self._exchange = exchange
        self._loop = loop

    def exchange(self, endpoint: str, payload: bytes, timeout_s: float) -> bytes:
        future = asyncio.run_coroutine_threadsafe(self._call(endpoint, payload, timeout_s), self._loop)
        return future.result(timeout_s + 1.0)

    async def _call(self, endpoint: str, payload: bytes, timeout_s: float) -> bytes:
        return await asyncio.wait_for(self._exchange(endpoint, payload), timeout_s)
