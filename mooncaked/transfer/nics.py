"""A host's NICs for TCP transfers: which addresses an engine listens on, and which NIC pairs join two engines.

1. `Nic.parse(name, address, numa_node, devices)`: `address` is an IP address, optionally with its subnet's
   prefix length ("10.0.1.2/24"). `numa_node` and `devices` ("cuda:0", ...) say which memory the NIC serves;
   a NIC with neither serves every location.
2. `nic_pairs(local, remote)`: every (local NIC, remote NIC) pair that has a link: the remote address lies in the
   local NIC's subnet (a NIC without a prefix length reaches every remote NIC). In a multi-rail cluster NIC k
   of every host shares rail k's subnet, so two hosts with K NICs each get K pairs.
3. `serving_tier(nic, location)`: 0 when the NIC serves memory at `location` ("cpu:N" on its NUMA node, or a
   device it lists, or it names none), else 1; path choice prefers tier 0 (dispatch.py).
4. The advertisement: after a data handshake succeeds the server's last reply carries its NICs
   (`encode_advert`), so a client learns every address of its peer from the peer itself. Format: u8 version
   (1), u8 count, then per NIC u8 length + name, u8 length + address text (with "/prefix" when known).
   `decode_advert` raises ValueError on anything else; an empty advertisement (a server without NICs) is
   no NICs.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

ADVERT_VERSION = 1
MAX_NICS = 64
_MAX_TEXT_BYTES = 255


@dataclass(frozen=True)
class Nic:
    name: str
    address: str  # the IP address alone
    prefix_len: int | None = None  # subnet of `address`; None: reaches every peer NIC
    numa_node: int | None = None
    devices: tuple[str, ...] = ()

    @classmethod
    def parse(cls, name: str, address: str, numa_node: int | None = None, devices: Sequence[str] = ()) -> Nic:
        """ValueError saying what is wrong with `address` or `name`."""
        if not name or len(name.encode()) > _MAX_TEXT_BYTES:
            raise ValueError(f"NIC name must be 1..{_MAX_TEXT_BYTES} bytes, got {name!r}")
        text, slash, prefix_text = address.partition("/")
        try:
            ip = ipaddress.ip_address(text)
            prefix_len = ipaddress.ip_network(address, strict=False).prefixlen if slash else None
        except ValueError:
            raise ValueError(f"NIC {name}: address must be an IP address, optionally with /prefix "
                             f"(e.g. 10.0.1.2/24), got {address!r}") from None
        return cls(name, str(ip), prefix_len, numa_node, tuple(devices))

    @property
    def text(self) -> str:
        return self.address if self.prefix_len is None else f"{self.address}/{self.prefix_len}"

    def reaches(self, remote: Nic) -> bool:
        if self.prefix_len is None:
            return True
        network = ipaddress.ip_network(self.text, strict=False)
        return ipaddress.ip_address(remote.address) in network


def nic_pairs(local: Sequence[Nic], remote: Sequence[Nic]) -> list[tuple[Nic, Nic]]:
    return [(mine, theirs) for mine in local for theirs in remote if mine.reaches(theirs)]


def serving_tier(nic: Nic, location: str) -> int:
    if nic.numa_node is None and not nic.devices:
        return 0
    if location in nic.devices or (nic.numa_node is not None and location == f"cpu:{nic.numa_node}"):
        return 0
    return 1


def encode_advert(nics: Sequence[Nic]) -> bytes:
    if len(nics) > MAX_NICS:
        raise ValueError(f"at most {MAX_NICS} NICs, got {len(nics)}")
    out = bytearray([ADVERT_VERSION, len(nics)])
    for nic in nics:
        for text in (nic.name.encode(), nic.text.encode()):
            out.append(len(text))
            out += text
    return bytes(out)


def decode_advert(data: bytes) -> list[Nic]:
    if not data:
        return []
    if len(data) < 2 or data[0] != ADVERT_VERSION:
        raise ValueError(f"NIC advertisement of version {data[0]}, expected {ADVERT_VERSION}")
    count, offset, nics = data[1], 2, []
    if count > MAX_NICS:
        raise ValueError(f"NIC advertisement of {count} NICs, more than {MAX_NICS}")
    for _ in range(count):
        texts = []
        for _ in range(2):
            if offset >= len(data) or offset + 1 + data[offset] > len(data):
                raise ValueError("NIC advertisement truncated")
            raw = data[offset + 1: offset + 1 + data[offset]]
            offset += 1 + data[offset]
            try:
                texts.append(raw.decode())
            except UnicodeDecodeError:
                raise ValueError("NIC advertisement with a name or address that is not UTF-8") from None
        nics.append(Nic.parse(texts[0], texts[1]))
    if offset != len(data):
        raise ValueError(f"NIC advertisement with {len(data) - offset} bytes after its last NIC")
    return nics
