"""An in-process fake of the verbs interface: NICs on named hosts, memory regions, RC queue pairs that move
bytes between registered buffers, and failure injection (a NIC down, queue pairs broken once)."""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from mooncaked.transfer.types import TransferOp
from mooncaked.transfer.verbs import Completion, QpInfo, RdmaUnavailable, WorkRequest, buffer_address


@dataclass
class FakeRegion:
    nic: FakeNic
    view: memoryview
    addr: int
    length: int
    lkey: int
    rkey: int
    is_closed: bool = False

    def close(self) -> None:
        self.is_closed = True
        self.nic.fabric.drop_region(self)

    def slice(self, addr: int, length: int) -> memoryview | None:
        start = addr - self.addr
        if self.is_closed or start < 0 or start + length > self.length:
            return None
        return self.view[start : start + length]


@dataclass(eq=False)
class FakeQueuePair:
    nic: FakeNic
    qp_num: int
    psn: int = 0
    remote: tuple[str, int] | None = None  # (remote nic gid, remote qp_num)
    state: str = "init"
    completions: collections.deque[Completion] = field(default_factory=collections.deque)

    def info(self) -> QpInfo:
        return QpInfo(self.nic.name, self.qp_num, self.nic.lid, self.nic.gid, self.psn)

    def connect(self, remote: QpInfo) -> None:
        if self.state != "init":
            raise OSError(f"qp {self.qp_num} is {self.state}, cannot connect")
        self.remote = (remote.gid, remote.qp_num)
        self.state = "rts"

    def post(self, requests: Sequence[WorkRequest]) -> None:
        if self.state == "closed":
            raise OSError(f"qp {self.qp_num} is closed")
        self.nic.fabric.num_posts += 1
        for request in requests:
            status = "IBV_WC_WR_FLUSH_ERR" if self.state == "error" else self.nic.fabric.execute(self, request)
            if status != "success":
                self.state = "error"
            self.completions.append(Completion(request.wr_id, status == "success", status))

    def poll(self, max_entries: int) -> list[Completion]:
        return [self.completions.popleft() for _ in range(min(max_entries, len(self.completions)))]

    def close(self) -> None:
        self.state = "closed"


class FakeNic:
    def __init__(self, fabric: FakeFabric, host: str, name: str, lid: int) -> None:
        self.fabric = fabric
        self.host = host
        self.name = name
        self.lid = lid
        self.gid = f"fake:{host}:{name}"

    def register(self, view: memoryview, is_device: bool = False) -> FakeRegion:
        if is_device and self.gid not in self.fabric.gpudirect_nics:
            raise OSError(f"{self.name}: cannot map GPU memory (no GPUDirect)")
        key = next(self.fabric.keys)
        region = FakeRegion(self, view, buffer_address(view), view.nbytes, key, key)
        self.fabric.add_region(region)
        return region

    def create_qp(self, max_send_wr: int) -> FakeQueuePair:
        return self.fabric.add_qp(self)

    def close(self) -> None:
        pass


class FakeProvider:
    def __init__(self, fabric: FakeFabric, host: str) -> None:
        self.fabric = fabric
        self.host = host

    def open_nic(self, name: str) -> FakeNic:
        return self.fabric.nic(self.host, name)


class FakeFabric:
    """Owns every fake NIC, region and queue pair of one test, and the injected faults."""

    def __init__(self, nics: dict[str, Sequence[str]], gpudirect: dict[str, Sequence[str]] | None = None) -> None:
        """`gpudirect`: per host, the NICs that can map GPU memory (the fake's "device memory" is host memory)."""
        self.keys = itertools.count(1000)
        self.gpudirect_nics = {f"fake:{h}:{n}" for h, names in (gpudirect or {}).items() for n in names}
        self._lock = threading.Lock()
        self._nics = {
            (host, name): FakeNic(self, host, name, lid)
            for lid, (host, name) in enumerate(((h, n) for h, names in nics.items() for n in names), start=1)
        }
        self._regions: dict[int, FakeRegion] = {}
        self._qps: dict[tuple[str, int], FakeQueuePair] = {}
        self.down_nics: set[str] = set()  # gids
        self.num_qps_created = 0
        self.num_posts = 0
        self.bytes_by_pair: collections.Counter[tuple[str, str]] = collections.Counter()
        self.wr_lengths: list[int] = []

    def provider(self, host: str) -> FakeProvider:
        return FakeProvider(self, host)

    def nic(self, host: str, name: str) -> FakeNic:
        nic = self._nics.get((host, name))
        if nic is None:
            raise RdmaUnavailable(f"no fake NIC {name} on {host}")
        return nic

    def set_down(self, host: str, name: str, is_down: bool = True) -> None:
        gid = self.nic(host, name).gid
        with self._lock:
            (self.down_nics.add if is_down else self.down_nics.discard)(gid)

    def break_qps(self, host: str, name: str) -> int:
        """Put every live queue pair on that NIC into the error state (a link flap); returns how many."""
        with self._lock:
            broken = [qp for qp in self._qps.values() if qp.nic is self.nic(host, name) and qp.state == "rts"]
            for qp in broken:
                qp.state = "error"
        return len(broken)

    def live_qps(self) -> list[FakeQueuePair]:
        with self._lock:
            return [qp for qp in self._qps.values() if qp.state != "closed"]

    def add_region(self, region: FakeRegion) -> None:
        with self._lock:
            self._regions[region.rkey] = region

    def drop_region(self, region: FakeRegion) -> None:
        with self._lock:
            self._regions.pop(region.rkey, None)

    def add_qp(self, nic: FakeNic) -> FakeQueuePair:
        with self._lock:
            self.num_qps_created += 1
            qp = FakeQueuePair(nic, self.num_qps_created, psn=self.num_qps_created * 7)
            self._qps[(nic.gid, qp.qp_num)] = qp
        return qp

    def execute(self, qp: FakeQueuePair, request: WorkRequest) -> str:
        with self._lock:
            peer = self._qps.get(qp.remote) if qp.remote is not None else None
            if qp.nic.gid in self.down_nics or peer is None or peer.nic.gid in self.down_nics:
                return "IBV_WC_RETRY_EXC_ERR"
            if peer.state != "rts" or peer.remote != (qp.nic.gid, qp.qp_num):
                return "IBV_WC_RETRY_EXC_ERR"
            local, remote = self._regions.get(request.lkey), self._regions.get(request.rkey)
            if local is None or local.nic is not qp.nic:
                return "IBV_WC_LOC_PROT_ERR"
            if remote is None or remote.nic is not peer.nic:
                return "IBV_WC_REM_ACCESS_ERR"
            local_view = local.slice(request.local_addr, request.length)
            remote_view = remote.slice(request.remote_addr, request.length)
            if local_view is None or remote_view is None:
                return "IBV_WC_REM_ACCESS_ERR" if remote_view is None else "IBV_WC_LOC_PROT_ERR"
            self.bytes_by_pair[(qp.nic.name, peer.nic.name)] += request.length
            self.wr_lengths.append(request.length)
        if request.op is TransferOp.WRITE:
            remote_view[:] = local_view
        else:
            local_view[:] = remote_view
        return "success"
