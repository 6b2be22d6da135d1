"""Round trips of every wire message type in both forms (map and array), and the decoders' refusals."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import msgpack
import pytest

from mooncaked.rpc.protocol import (FRAME_TYPES, HEALTH, INFO, PROTOCOL_VERSION, Auth, CallFrame, CancelFrame,
                                    Challenge, EndFrame, ErrorFrame, HealthReply, HealthRequest, Hello, InfoReply,
                                    InfoRequest, ItemFrame, Message, ProtocolError, ResultFrame, Welcome, decode_array,
                                    decode_frame, decode_message, encode_array, encode_frame, encode_message)

ALL_MESSAGES: list[Message] = [
    HealthRequest(),
    HealthReply(is_healthy=True),
    HealthReply(is_healthy=False, status="draining"),
    InfoRequest(),
    InfoReply(role="store", instance="store-0", version="0.1.0", pid=4242, uptime_s=12.5,
              extra={"dram_bytes": "1073741824"}),
]

ALL_FRAMES = [
    Hello(PROTOCOL_VERSION, "conductor", "conductor-0", "cluster-a", b"n" * 16),
    Challenge(PROTOCOL_VERSION, "store", "store-0", b"s" * 16, b"p" * 32),
    Auth(b"p" * 32),
    Welcome(max_frame_bytes=4 << 20, max_inflight_calls=1024),
    CallFrame(7, "health", encode_array(HealthRequest()), 2.5),
    ResultFrame(7, encode_array(HealthReply(True))),
    ErrorFrame(7, "not_found", "no such block"),
    ItemFrame(8, encode_array(HealthReply(True))),
    EndFrame(8),
    CancelFrame(9),
]


def over_the_wire(data: Any) -> Any:
    return msgpack.unpackb(msgpack.packb(data))


@pytest.mark.parametrize("message", ALL_MESSAGES, ids=lambda m: type(m).__name__)
def test_message_round_trip(message: Message) -> None:
    assert decode_message(type(message), over_the_wire(encode_message(message))) == message
    assert decode_array(type(message), over_the_wire(encode_array(message))) == message


@pytest.mark.parametrize("frame", ALL_FRAMES, ids=lambda f: type(f).__name__)
def test_frame_round_trip(frame: Any) -> None:
    data = over_the_wire(encode_frame(frame))
    if frame.TAG >= 0:  # call frames: [TAG, fields...]
        assert data[0] == frame.TAG and len(data) == len(encode_array(frame))
    else:  # handshake frames: {"t": TYPE, fields...}
        assert data["t"] == frame.TYPE and "v" not in data
    assert decode_frame(data) == frame
    assert decode_message(type(frame), encode_message(frame)) == frame


def test_every_frame_type_has_a_round_trip() -> None:
    assert {type(f) for f in ALL_FRAMES} == set(FRAME_TYPES.values())


def test_health_and_info_methods() -> None:
    assert (HEALTH.request, HEALTH.response, HEALTH.is_streaming) == (HealthRequest, HealthReply, False)
    assert (INFO.request, INFO.response) == (InfoRequest, InfoReply)


def test_version_mismatch_is_refused() -> None:
    data = encode_message(HealthReply(True))
    data["v"] = 2
    with pytest.raises(ProtocolError, match="version 2"):
        decode_message(HealthReply, data)
    del data["v"]
    with pytest.raises(ProtocolError, match="version None"):
        decode_message(HealthReply, data)


@dataclass(frozen=True)
class Inner(Message):
    key: bytes
    score: float


@dataclass(frozen=True)
class Outer(Message):
    VERSION = 3
    name: str
    token_ids: list[int]
    shape: tuple[int, ...]
    inner: Inner
    inners: list[Inner]
    by_name: dict[str, Inner]
    maybe: Optional[Inner] = None
    note: str | None = None
    tags: dict[str, str] = field(default_factory=dict)
    is_final: bool = False


OUTER = Outer("req-1", [1, 2, 3], (4, 5), Inner(b"\x00k", 0.5), [Inner(b"a", 1.0)], {"x": Inner(b"b", 2.0)},
              maybe=Inner(b"c", 3.0), note="hi", tags={"a": "b"}, is_final=True)


def test_nested_optional_tuple_and_dict_fields_round_trip() -> None:
    data = over_the_wire(encode_message(OUTER))
    assert data["v"] == 3 and data["inner"] == {"v": 1, "key": b"\x00k", "score": 0.5}
    decoded = decode_message(Outer, data)
    assert decoded == OUTER
    assert isinstance(decoded.shape, tuple)


def test_absent_fields_take_their_defaults() -> None:
    data = encode_message(OUTER)
    for name in ("maybe", "note", "tags", "is_final"):
        del data[name]
    decoded = decode_message(Outer, data)
    assert (decoded.maybe, decoded.note, decoded.tags, decoded.is_final) == (None, None, {}, False)


def test_float_field_accepts_an_int() -> None:
    decoded = decode_message(Inner, {"v": 1, "key": b"k", "score": 2})
    assert decoded.score == 2.0 and type(decoded.score) is float


@pytest.mark.parametrize("change, match", [
    ({"name": 5}, "Outer.name: expected str, got int"),
    ({"token_ids": [1, "2"]}, r"Outer.token_ids\[\]: expected int, got str"),
    ({"token_ids": [1, True]}, r"Outer.token_ids\[\]: expected int, got bool"),
    ({"token_ids": "123"}, "Outer.token_ids: expected a list"),
    ({"is_final": 1}, "Outer.is_final: expected bool, got int"),
    ({"inner": {"v": 1, "key": "not bytes", "score": 1.0}}, "Inner.key: expected bytes, got str"),
    ({"inner": {"v": 2, "key": b"k", "score": 1.0}}, "Inner: version 2"),
    ({"by_name": {"x": 1}}, "Inner: expected a map, got int"),
    ({"tags": {"a": 1}}, r"Outer.tags\{\}: expected str, got int"),
    ({"unexpected": 1}, r"unknown field\(s\) \['unexpected'\]"),
])
def test_bad_fields_are_refused_with_the_field_named(change: dict[str, Any], match: str) -> None:
    data = {**encode_message(OUTER), **change}
    with pytest.raises(ProtocolError, match=match):
        decode_message(Outer, data)


def test_missing_required_field_is_named() -> None:
    data = encode_message(OUTER)
    del data["token_ids"]
    with pytest.raises(ProtocolError, match="missing field 'token_ids'"):
        decode_message(Outer, data)


def test_not_a_map_is_refused() -> None:
    with pytest.raises(ProtocolError, match="expected a map, got list"):
        decode_message(HealthReply, [1, 2])


def test_unknown_frame_type_is_refused() -> None:
    with pytest.raises(ProtocolError, match="unknown type 'launch'"):
        decode_frame({"t": "launch", "v": 1})
    with pytest.raises(ProtocolError, match="unknown type None"):
        decode_frame({"id": 3})
    with pytest.raises(ProtocolError, match="unknown type 'end'"):  # call frames are arrays
        decode_frame({"t": "end", "id": 3})
    with pytest.raises(ProtocolError, match="carry no"):
        decode_frame({"t": "auth", "v": 1, "proof": b""})
    with pytest.raises(ProtocolError, match="unknown call frame tag 42"):
        decode_frame([42, 3])
    with pytest.raises(ProtocolError, match="unknown call frame tag None"):
        decode_frame([])
    with pytest.raises(ProtocolError, match="expected a map or an array, got int"):
        decode_frame(7)
    with pytest.raises(ProtocolError, match=r"EndFrame.id: expected int, got str"):
        decode_frame([EndFrame.TAG, "3"])


def test_post_init_validation_runs_on_decode() -> None:
    @dataclass(frozen=True)
    class Positive(Message):
        n: int

        def __post_init__(self) -> None:
            if self.n <= 0:
                raise ValueError("n must be positive")

    assert decode_message(Positive, {"v": 1, "n": 3}) == Positive(3)
    with pytest.raises(ValueError, match="positive"):
        decode_message(Positive, {"v": 1, "n": -1})


def test_array_form_nests_arrays_and_round_trips() -> None:
    data = over_the_wire(encode_array(OUTER))
    assert data[0] == 3 and data[4] == [1, b"\x00k", 0.5] and data[6] == {"x": [1, b"b", 2.0]}
    decoded = decode_array(Outer, data)
    assert decoded == OUTER and isinstance(decoded.shape, tuple)


def test_array_form_fills_absent_trailing_defaults() -> None:
    data = encode_array(OUTER)[:7]
    decoded = decode_array(Outer, data)
    assert (decoded.maybe, decoded.note, decoded.tags, decoded.is_final) == (None, None, {}, False)
    assert decode_array(Inner, [1, b"k", 2]).score == 2.0


@pytest.mark.parametrize("data, match", [
    ([3, 5] + encode_array(OUTER)[2:], "Outer.name: expected str, got int"),
    (encode_array(OUTER)[:2], "Outer: missing field 'token_ids'"),
    (encode_array(OUTER) + [1], "Outer: 11 values but the message has 10 fields"),
    ([2] + encode_array(OUTER)[1:], "Outer: version 2 but this build speaks version 3"),
    ([], "Outer: version None"),
    (encode_message(OUTER), "Outer: expected an array, got dict"),
    (encode_array(OUTER)[:4] + [[1, "not bytes", 1.0]] + encode_array(OUTER)[5:], "Inner.key: expected bytes"),
    (encode_array(OUTER)[:4] + [{"v": 1, "key": b"k", "score": 1.0}] + encode_array(OUTER)[5:],
     "Inner: expected an array, got dict"),
])
def test_array_form_refusals_name_the_fault(data: Any, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode_array(Outer, data)


def test_method_caches_its_array_codecs() -> None:
    assert HEALTH.encode_request(HealthRequest()) == [1]
    assert HEALTH.decode_response([1, False, "draining"]) == HealthReply(False, "draining")
    assert HEALTH.encode_request is HEALTH.encode_request
