"""Control messages round-trip; malformed ones are rejected with a reason; the tcp control channel."""

from __future__ import annotations

import pytest

from mooncaked.transfer import TransferEngine
from mooncaked.transfer.control import (
    ConnectReply,
    ConnectRequest,
    DescribeReply,
    DescribeRequest,
    DisconnectReply,
    DisconnectRequest,
    RegionInfo,
    SegmentInfo,
    TcpControlChannel,
    decode_control,
    encode_control,
)
from mooncaked.transfer.handshake import DataCredentials
from mooncaked.transfer.verbs import QpInfo

QP = QpInfo("mlx5_0", 77, 3, "fe80::1", 0xABCDE)


@pytest.mark.parametrize(
    "message",
    [
        DescribeRequest(["pool", "staging"]),
        DescribeReply(["mlx5_0"], {"cpu:0": {"preferred": ["mlx5_0"], "secondary": []}},
                      {"pool": SegmentInfo("cpu:0", 4096, {"mlx5_0": RegionInfo(0x7F0000001000, 42)})}),
        ConnectRequest("10.0.0.1:7000", "mlx5_1", QP),
        ConnectReply(QP),
        DisconnectRequest("10.0.0.1:7000", "mlx5_0", "mlx5_1"),
        DisconnectReply(True),
    ],
)
def test_round_trip(message: object) -> None:
    assert decode_control(encode_control(message)) == message  # type: ignore[arg-type]


def test_bad_messages_say_why() -> None:
    with pytest.raises(ValueError, match="malformed control message"):
        decode_control(b"{nope")
    with pytest.raises(ValueError, match="control message version 9 is not 1"):
        decode_control(b'{"v": 9, "kind": "describe", "body": {}}')
    with pytest.raises(ValueError, match="unknown control message kind 'hello'"):
        decode_control(b'{"v": 1, "kind": "hello", "body": {}}')
    with pytest.raises(ValueError, match="QpInfo version 2 is not 1"):
        QpInfo.from_dict({"v": 2})


async def test_tcp_control_channel_reaches_an_engine_without_rdma() -> None:
    engine = TransferEngine(host="127.0.0.1")
    await engine.start()
    try:
        channel = TcpControlChannel(DataCredentials())
        reply = channel.exchange(engine.endpoint, encode_control(DescribeRequest(["x"])), 5)
        assert decode_control(reply) == DescribeReply([], {})
        with pytest.raises(ConnectionError, match="rdma is not active"):
            channel.exchange(engine.endpoint, encode_control(DisconnectRequest("a:1", "n", "m")), 5)
    finally:
        await engine.stop()
