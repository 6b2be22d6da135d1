"""The narrow verbs interface the RDMA transport uses, implemented by pyverbs (`pyverbs_provider`) and by the
in-process fake in the tests.

1. A `VerbsProvider` opens NICs by name; a `VerbsNic` registers memory regions and creates RC queue pairs.
2. A queue pair reports its `QpInfo`, is connected to the peer's `QpInfo` (INIT -> RTR -> RTS), then takes
   RDMA READ/WRITE work requests (`post`) whose completions are polled (`poll`) off the event loop.
3. A failed completion leaves the queue pair in the error state; its owner closes it and builds a new one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from mooncaked.transfer.types import TransferOp


class RdmaUnavailable(Exception):
    """No usable RDMA stack here (pyverbs missing, no device); the message says which."""


@dataclass(frozen=True)
class QpInfo:
    """What a peer needs to connect to one RC queue pair."""

    VERSION: ClassVar[int] = 1
    nic: str
    qp_num: int
    lid: int
    gid: str  # "" on InfiniBand without a GRH
    psn: int

    def to_dict(self) -> dict[str, Any]:
        fields = {"nic": self.nic, "qp_num": self.qp_num, "lid": self.lid, "gid": self.gid, "psn": self.psn}
        return {"v": self.VERSION, **fields}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> QpInfo:
        if data.get("v") != cls.VERSION:
            raise ValueError(f"QpInfo version {data.get('v')!r} is not {cls.VERSION}")
        return cls(str(data["nic"]), int(data["qp_num"]), int(data["lid"]), str(data["gid"]), int(data["psn"]))


@dataclass(frozen=True)
class WorkRequest:
    wr_id: int
    op: TransferOp
    local_addr: int
    length: int
    lkey: int
    remote_addr: int
    rkey: int


@dataclass(frozen=True)
class Completion:
    wr_id: int
    is_ok: bool
    status: str  # "success" or the provider's error name


class VerbsMemoryRegion(Protocol):
    @property
    def addr(self) -> int: ...
    @property
    def length(self) -> int: ...
    @property
    def lkey(self) -> int: ...
    @property
    def rkey(self) -> int: ...
    def close(self) -> None: ...


class VerbsQueuePair(Protocol):
    def info(self) -> QpInfo: ...
    def connect(self, remote: QpInfo) -> None: ...
    def post(self, requests: Sequence[WorkRequest]) -> None: ...
    def poll(self, max_entries: int) -> list[Completion]: ...
    def close(self) -> None: ...


class VerbsNic(Protocol):
    @property
    def name(self) -> str: ...
    def register(self, view: memoryview, is_device: bool = False) -> VerbsMemoryRegion:
        """`is_device`: the view spans GPU memory (GPUDirect; OSError where the NIC or driver cannot)."""
        ...
    def create_qp(self, max_send_wr: int) -> VerbsQueuePair: ...
    def close(self) -> None: ...


class VerbsProvider(Protocol):
    def open_nic(self, name: str) -> VerbsNic: ...


def buffer_address(view: memoryview) -> int:
    """The address of a writable memoryview's first byte."""
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(view))
