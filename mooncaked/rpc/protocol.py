"""Wire message types: versioned frozen dataclasses and their msgpack-ready forms.

Lifecycle of a message:
  1. A sender builds a `Message` dataclass and encodes it: `encode_message` gives the map form (field names
     plus "v", the class VERSION), `encode_array` the array form ([VERSION, values in field order]) that RPC
     calls carry; nested messages take their parent's form.
  2. The RPC layer packs it with msgpack inside a frame (see `mooncaked.rpc.frames`).
  3. The receiver calls `decode_message(cls, data)` / `decode_array(cls, data)`: the version must equal
     `cls.VERSION`, every value must be of its declared type, every required field present (in the array
     form only trailing fields with defaults may be absent); anything else is a ProtocolError.
     (The codec itself lives in mooncaked.rpc.codec; its names are re-exported here.)

Frames (the RPC envelope) are Messages too. Handshake frames are maps tagged with a TYPE string (so a peer of
another protocol version can still read Hello and say what is wrong); call frames, which follow a handshake
that agreed on PROTOCOL_VERSION, are arrays [TAG, values...] with a small integer TAG. Both are dispatched
through the explicit table FRAME_TYPES. Domain messages live next to the service that serves them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Generic, TypeVar

from mooncaked.rpc.codec import (ProtocolError, array_decoder_for, array_encoder_for, decode_array, decode_message,
                                 decoder_for, encode_array, encode_message, encoder_for)

__all__ = [
    "FRAME_TYPES", "HEALTH", "INFO", "PROTOCOL_VERSION", "Auth", "CallFrame", "CancelFrame", "Challenge", "EndFrame",
    "ErrorFrame", "Frame", "HealthReply", "HealthRequest", "Hello", "InfoReply", "InfoRequest", "ItemFrame",
    "Message", "Method", "ProtocolError", "ReqT", "RespT", "ResultFrame", "Welcome", "array_decoder_for",
    "array_encoder_for", "decode_array", "decode_frame", "decode_message", "decoder_for", "encode_array",
    "encode_frame", "encode_message", "encoder_for",
]

PROTOCOL_VERSION = 2  # 2: call frames and their messages in the array form


@dataclass(frozen=True)
class Message:
    """Base of every wire message; subclasses are frozen dataclasses and bump VERSION on incompatible change."""

    VERSION: ClassVar[int] = 1


ReqT = TypeVar("ReqT", bound=Message)
RespT = TypeVar("RespT", bound=Message)


@dataclass(frozen=True)
class Method(Generic[ReqT, RespT]):
    """One RPC method: its wire name, request and response (for streams: item) types.

    encode_request / decode_response are the array-form codecs of request and response, for the client's
    per-call path. They are looked up on first use (a message may refer to types defined after its Method),
    then kept as plain attributes: plain attribute reads are the fast ones.
    """

    name: str
    request: type[ReqT]
    response: type[RespT]
    is_streaming: bool = False
    encode_request: Callable[[ReqT], list[Any]] = field(init=False, repr=False, compare=False)
    decode_response: Callable[[Any], RespT] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "encode_request", self._first_encode_request)
        object.__setattr__(self, "decode_response", self._first_decode_response)

    def _first_encode_request(self, request: ReqT) -> list[Any]:
        object.__setattr__(self, "encode_request", array_encoder_for(self.request))
        return self.encode_request(request)

    def _first_decode_response(self, data: Any) -> RespT:
        object.__setattr__(self, "decode_response", array_decoder_for(self.response))
        return self.decode_response(data)


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
    """A handshake frame's wire form is a map of its fields plus "t": TYPE; a call frame's (TAG >= 0) is the
    array [TAG, fields...] (see encode_frame).

    The RPC hot path (call, result, error, item, end, cancel) reads and writes these arrays element by element
    instead of building the dataclasses; tests check that both forms agree. Message payloads (args, result,
    item) are in the array form.
    """

    TYPE: ClassVar[str] = ""
    TAG: ClassVar[int] = -1


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
    TAG: ClassVar[int] = 0
    id: int
    method: str
    args: list[Any]
    timeout_s: float


@dataclass(frozen=True)
class ResultFrame(Frame):
    TYPE: ClassVar[str] = "result"
    TAG: ClassVar[int] = 1
    id: int
    result: list[Any]


@dataclass(frozen=True)
class ErrorFrame(Frame):
    """id 0 refers to the connection itself (handshake failures)."""

    TYPE: ClassVar[str] = "error"
    TAG: ClassVar[int] = 2
    id: int
    code: str
    message: str


@dataclass(frozen=True)
class ItemFrame(Frame):
    TYPE: ClassVar[str] = "item"
    TAG: ClassVar[int] = 3
    id: int
    item: list[Any]


@dataclass(frozen=True)
class EndFrame(Frame):
    TYPE: ClassVar[str] = "end"
    TAG: ClassVar[int] = 4
    id: int


@dataclass(frozen=True)
class CancelFrame(Frame):
    """Client -> server: the caller gave up on call `id`; the server cancels its handler."""

    TYPE: ClassVar[str] = "cancel"
    TAG: ClassVar[int] = 5
    id: int


FRAME_TYPES: dict[str, type[Frame]] = {
    cls.TYPE: cls
    for cls in (Hello, Challenge, Auth, Welcome, CallFrame, ResultFrame, ErrorFrame, ItemFrame, EndFrame,
                CancelFrame)
}
_CALL_FRAMES_BY_TAG: dict[int, type[Frame]] = {cls.TAG: cls for cls in FRAME_TYPES.values() if cls.TAG >= 0}


def encode_frame(frame: Frame) -> dict[str, Any] | list[Any]:
    """The frame's wire form, without a version (the handshake's protocol_version covers frames, which saves
    an element on every call and reply): [TAG, fields...] for call frames, {"t": TYPE, fields...} otherwise."""
    if frame.TAG >= 0:
        values = encode_array(frame)
        values[0] = frame.TAG
        return values
    data = encode_message(frame)
    del data["v"]
    data["t"] = frame.TYPE
    return data


def decode_frame(data: Any) -> Frame:
    """The frame in `data`, dispatched on its tag through FRAME_TYPES; ProtocolError otherwise."""
    if type(data) is list:
        tag = data[0] if data else None
        call_cls = _CALL_FRAMES_BY_TAG.get(tag) if type(tag) is int else None
        if call_cls is None:
            raise ProtocolError(f"frame: unknown call frame tag {tag!r}")
        return decode_array(call_cls, [call_cls.VERSION, *data[1:]])
    if not isinstance(data, dict):
        raise ProtocolError(f"frame: expected a map or an array, got {type(data).__name__}")
    type_name = data.get("t")
    cls = FRAME_TYPES.get(type_name) if isinstance(type_name, str) else None
    if cls is None or cls.TAG >= 0:
        raise ProtocolError(f"frame: unknown type {type_name!r}")
    if "v" in data:
        raise ProtocolError(f"frame {type_name!r}: frames carry no \"v\"; the handshake sets the protocol version")
    fields = {k: v for k, v in data.items() if k != "t"}
    fields["v"] = cls.VERSION
    return decode_message(cls, fields)
