"""NICs: parsing, which pairs have a link, which memory a NIC serves, and the advertisement's round trip
(hostile bytes are a ValueError, never another exception)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncaked.transfer.nics import Nic, decode_advert, encode_advert, nic_pairs, serving_tier


def test_parse_takes_an_address_with_or_without_its_prefix() -> None:
    assert Nic.parse("nic0", "10.77.0.1/24") == Nic("nic0", "10.77.0.1", 24)
    assert Nic.parse("nic1", "fd00::5", 1, ["cuda:0"]) == Nic("nic1", "fd00::5", None, 1, ("cuda:0",))
    for bad in ("10.77.0.300", "eth0", "10.0.0.1/40", ""):
        with pytest.raises(ValueError, match="address must be an IP address"):
            Nic.parse("nic0", bad)
    with pytest.raises(ValueError, match="name"):
        Nic.parse("", "10.0.0.1")


def test_pairs_join_the_nics_of_one_rail() -> None:
    local = [Nic.parse("nic0", "10.77.0.1/24"), Nic.parse("nic1", "10.77.1.1/24")]
    remote = [Nic.parse("eth0", "10.77.0.2/24"), Nic.parse("eth1", "10.77.1.2/24")]
    assert [(a.name, b.name) for a, b in nic_pairs(local, remote)] == [("nic0", "eth0"), ("nic1", "eth1")]
    assert len(nic_pairs([Nic.parse("any", "10.0.0.1")], remote)) == 2, "no prefix: every remote NIC"
    assert nic_pairs(local, [Nic.parse("far", "192.168.0.1/24")]) == []


def test_a_nic_serves_its_numa_node_and_devices() -> None:
    nic = Nic.parse("nic0", "10.0.0.1", numa_node=1, devices=["cuda:2"])
    assert [serving_tier(nic, loc) for loc in ("cpu:1", "cuda:2", "cpu:0", "cuda:0")] == [0, 0, 1, 1]
    assert serving_tier(Nic.parse("nic1", "10.0.0.2"), "cuda:0") == 0, "one naming nothing serves all"


def test_the_advertisement_round_trips() -> None:
    nics = [Nic.parse("nic0", "10.77.0.1/24"), Nic.parse("nic1", "fd00::1")]
    assert decode_advert(encode_advert(nics)) == nics
    assert decode_advert(b"") == []
    with pytest.raises(ValueError, match="version"):
        decode_advert(b"\x02\x00")


@given(st.binary(max_size=80))
def test_hostile_advertisements_are_value_errors(data: bytes) -> None:
    try:
        nics = decode_advert(data)
    except ValueError:
        return
    assert decode_advert(encode_advert(nics)) == nics
