import msgpack
import pytest

from mooncaked.rpc.protocol import Message, ProtocolError, decode_message, encode_message
from mooncaked.store import messages as m

KEY = bytes(range(16))
LOCATION = m.BlockLocation(KEY, "dram", 8192, 1 << 20)

SAMPLES: list[Message] = [
    m.WriteHandle(7, KEY, 4096, 1 << 20),
    LOCATION,
    m.AllocateRequest([KEY, KEY[::-1]], 1 << 20, 30_000, first_position=3),
    m.AllocateReply([m.WriteHandle(7, KEY, 4096, 1 << 20)], [LOCATION], 9),
    m.CommitRequest([1, 2, 3]),
    m.CommitReply(2, 1),
    m.AbortRequest([4]),
    m.AbortReply(1),
    m.LookupRequest([KEY], lease_ms=500),
    m.LookupReply([LOCATION], 11),
    m.ReleaseRequest([11]),
    m.ReleaseReply(1),
    m.PinRequest([KEY], 60_000),
    m.PinReply([]),
    m.UnpinRequest([KEY]),
    m.UnpinReply(1),
    m.StatsRequest(),
    m.StatsReply({"used_bytes": 5}, "/dev/shm/mooncaked-c-s", 1 << 30, "127.0.0.1:5000", "pool", "host-a"),
    m.StoreEventMessage(5, "stored", KEY),
    m.EventsRequest(4),
    m.EventBatch([m.StoreEventMessage(5, "removed", KEY)]),
    m.DumpRequest(),
    m.DumpChunk(5, [KEY], is_last=False),
    m.MarkSpareRequest([KEY], [KEY[::-1]]),
    m.MarkSpareReply(2),
]


@pytest.mark.parametrize("message", SAMPLES, ids=lambda msg: type(msg).__name__)
def test_round_trip_through_msgpack(message: Message) -> None:
    wire = msgpack.unpackb(msgpack.packb(encode_message(message)), raw=False)
    assert decode_message(type(message), wire) == message


def test_every_method_names_its_message_types() -> None:
    names = [method.name for method in m.STORE_METHODS]
    assert len(set(names)) == len(names) and all(name.startswith("store.") for name in names)
    assert m.EVENTS.is_streaming and m.DUMP.is_streaming and not m.ALLOCATE.is_streaming


def test_wrong_field_type_is_rejected() -> None:
    data = encode_message(m.CommitRequest([1]))
    data["handle_ids"] = ["1"]
    with pytest.raises(ProtocolError, match="handle_ids"):
        decode_message(m.CommitRequest, data)
