"""Wire message types: versioned frozen dataclasses and their msgpack-ready dict form.

Lifecycle of a message:
  1. A sender builds a `Message` dataclass and calls `encode_message` (a plain dict: field names plus "v",
     the class VERSION; nested messages become nested dicts).
  2. The RPC layer packs that dict with msgpack inside a frame (see `mooncaked.rpc_frames`).
  3. The receiver calls `decode_message(cls, data)`: the version must equal `cls.VERSION`, every key must be a
     field, every required field present, every value of its declared type; anything else is a ProtocolError.
     (The codec itself lives in mooncaked.rpc_codec; its names are re-exported here.)

Frames (the RPC envelope) and handshake messages are Messages too, tagged with a TYPE and dispatched through
the explicit table FRAME_TYPES. Domain messages live next to the service that serves them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

from mooncaked.rpc_codec import ProtocolError, decode_message, decoder_for, encode_message, encoder_for

__all__ = [
    "FRAME_TYPES", "HEALTH", "INFO", "PROTOCOL_VERSION", "Auth", "CallFrame", "CancelFrame", "Challenge", "EndFrame",
    "ErrorFrame", "Frame", "HealthReply", "HealthRequest", "Hello", "InfoReply", "InfoRequest", "ItemFrame",
    "Message", "Method", "ProtocolError", "ReqT", "RespT", "ResultFrame", "Welcome", "decode_frame",
    "decode_message", "decoder_for", "encode_frame", "encode_message", "encoder_for",
]

PROTOCOL_VERSION = 1


@dataclass(frozen=True)
class Message:
    """Base of every wire message; subclasses are frozen dataclasses and bump VERSION on incompatible change."""

    VERSION: ClassVar[int] = 1


ReqT = TypeVar("ReqT", bound=Message)
RespT = TypeVar("RespT", bound=Message)


@dataclass(frozen=True)
class Method(Generic[ReqT, RespT]):
    """One RPC method: its wire name, request and response (for streams: item) types."""

    name: str
    request: type[ReqT]
    response: type[RespT]
    is_streaming: bool = False


# --- services every role serves ---------------------------------------------------------------


@dataclass(frozen=True)
class HealthRequest(Message):
    pass


@dataclass(frozen=True)
class HealthReply(Message):
    is_healthy: bool
    status: str = "ok"


@dataclass(frozen=True)
class InfoRequest(Message):
    pass


@dataclass(frozen=True)
class InfoReply(Message):
    role: str
    instance: str
    version: str
    pid: int
    uptime_s: float
    extra: dict[str, str] = field(default_factory=dict)


HEALTH = Method("health", HealthRequest, HealthReply)
INFO = Method("info", InfoRequest, InfoReply)


# --- frames: the RPC envelope, tagged with TYPE ----------------------------------------------


@dataclass(frozen=True)
class Frame(Message):
    """A frame's wire dict is its fields plus "t": TYPE (see encode_frame).

    The RPC hot path (call, result, error, item, end, cancel) reads and writes these dicts field by field
    instead of building the dataclasses; tests check that both forms agree.
    """

    TYPE: ClassVar[str] = ""


@dataclass(frozen=True)
class Hello(Frame):
    """Client -> server, first frame on a connection."""

    TYPE: ClassVar[str] = "hello"
    protocol_version: int
    role: str
    instance: str
    cluster_id: str
    client_nonce: bytes


@dataclass(frozen=True)
class Challenge(Frame):
    """Server -> client. server_proof is empty when the server has no secret (no authentication)."""

    TYPE: ClassVar[str] = "challenge"
    protocol_version: int
    role: str
    instance: str
    server_nonce: bytes
    server_proof: bytes


@dataclass(frozen=True)
class Auth(Frame):
    """Client -> server. proof is empty when the client has no secret."""

    TYPE: ClassVar[str] = "auth"
    proof: bytes


@dataclass(frozen=True)
class Welcome(Frame):
    """Server -> client: the connection is ready for calls."""

    TYPE: ClassVar[str] = "welcome"
    max_frame_bytes: int
    max_inflight_calls: int


@dataclass(frozen=True)
class CallFrame(Frame):
    """Client -> server: start call `id`; timeout_s is the time left when sent (clocks differ across hosts)."""

    TYPE: ClassVar[str] = "call"
    id: int
    method: str
    args: dict[str, Any]
    timeout_s: float


@dataclass(frozen=True)
class ResultFrame(Frame):
    TYPE: ClassVar[str] = "result"
    id: int
    result: dict[str, Any]


@dataclass(frozen=True)
class ErrorFrame(Frame):
    """id 0 refers to the connection itself (handshake failures)."""

    TYPE: ClassVar[str] = "error"
    id: int
    code: str
    message: str


@dataclass(frozen=True)
class ItemFrame(Frame):
    TYPE: ClassVar[str] = "item"
    id: int
    item: dict[str, Any]


@dataclass(frozen=True)
class EndFrame(Frame):
    TYPE: ClassVar[str] = "end"
    id: int


@dataclass(frozen=True)
class CancelFrame(Frame):
    """Client -> server: the caller gave up on call `id`; the server cancels its handler."""

    TYPE: ClassVar[str] = "cancel"
    id: int


FRAME_TYPES: dict[str, type[Frame]] = {
    cls.TYPE: cls
    for cls in (Hello, Challenge, Auth, Welcome, CallFrame, ResultFrame, ErrorFrame, ItemFrame, EndFrame,
                CancelFrame)
}


def encode_frame(frame: Frame) -> dict[str, Any]:
    """The frame's wire dict: its fields and "t": TYPE, without "v" (the handshake's protocol_version covers
    frames, which saves a key on every call and reply)."""
    data = encode_message(frame)
    del data["v"]
    data["t"] = frame.TYPE
    return data


def decode_frame(data: Any) -> Frame:
    """The frame in `data`, dispatched on its "t" tag through FRAME_TYPES; ProtocolError otherwise."""
    if not isinstance(data, dict):
        raise ProtocolError(f"frame: expected a map, got {type(data).__name__}")
    tag = data.get("t")
    cls = FRAME_TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise ProtocolError(f"frame: unknown type {tag!r}")
    if "v" in data:
        raise ProtocolError(f"frame {tag!r}: frames carry no \"v\"; the handshake sets the protocol version")
    fields = {k: v for k, v in data.items() if k != "t"}
    fields["v"] = cls.VERSION
    return decode_message(cls, fields)
