"""The rank command channel: messages round-trip, a closed end reads as ChannelClosed, a send to an end that
stopped reading fails within its deadline instead of blocking."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncaked.engine.tp.channel import ChannelClosed, RankChannel

_VALUES = st.recursive(st.none() | st.integers() | st.text(max_size=20) | st.binary(max_size=200),
                       lambda inner: st.lists(inner, max_size=4), max_leaves=20)


@settings(max_examples=50, deadline=None)
@given(values=st.lists(_VALUES, min_size=1, max_size=4))
def test_messages_round_trip(values: list[object]) -> None:
    ours, theirs_sock = RankChannel.pair(timeout_s=5.0)
    theirs = RankChannel(theirs_sock, timeout_s=5.0)
    try:
        ours.send(tuple(values))
        assert theirs.wait_readable(5.0)
        assert theirs.recv() == tuple(values)
    finally:
        ours.close()
        theirs.close()


def test_a_batch_of_tensors_round_trips_and_eof_is_channel_closed() -> None:
    ours, theirs_sock = RankChannel.pair(timeout_s=5.0)
    theirs = RankChannel(theirs_sock, timeout_s=5.0)
    tensors = (torch.arange(2000, dtype=torch.int64), torch.ones(3, 5, dtype=torch.int32))
    ours.send(("prefill", tensors))
    kind, received = theirs.recv()
    assert kind == "prefill" and all(torch.equal(a, b) for a, b in zip(received, tensors))
    ours.close()
    assert theirs.wait_readable(5.0)  # EOF is readable
    with pytest.raises(ChannelClosed, match="closed"):
        theirs.recv()
    theirs.close()


def test_a_send_nobody_reads_fails_within_the_deadline() -> None:
    ours, theirs_sock = RankChannel.pair(timeout_s=0.5)
    begin = time.monotonic()
    with pytest.raises(ChannelClosed):
        ours.send(("big", b"x" * (64 << 20)))  # far beyond the socket buffers
    assert time.monotonic() - begin < 5.0
    ours.close()
    theirs_sock.close()
