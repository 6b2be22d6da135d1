"""The verbs interface over pyverbs (rdma-core's Python binding; Debian package python3-pyverbs).

1. `PyverbsProvider.load()` imports pyverbs lazily and lists the devices; RdmaUnavailable says why when it cannot.
2. `open_nic` opens the device context, a protection domain and reads the port's LID and GID.
3. Memory regions are registered at the segment's own address (zero-copy) with local write, remote read and
   remote write access. Queue pairs are RC, one CQ each, every send signalled.
4. `connect` moves a queue pair INIT -> RTR -> RTS towards the peer's QpInfo; pyverbs errors become OSError.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from mooncaked.transfer.types import TransferOp
from mooncaked.transfer.verbs import Completion, QpInfo, RdmaUnavailable, WorkRequest, buffer_address


class PyverbsProvider:
    """Opens NICs through pyverbs; holds no state besides its settings."""

    def __init__(self, *, port_num: int = 1, gid_index: int = 0) -> None:
        self.port_num = port_num
        self.gid_index = gid_index

    @classmethod
    def load(cls, *, port_num: int = 1, gid_index: int = 0) -> PyverbsProvider:
        try:
            import pyverbs.device
        except ImportError as exc:
            raise RdmaUnavailable(
                f"pyverbs is not importable ({exc}); install Debian's python3-pyverbs and make "
                "/usr/lib/python3/dist-packages visible to this interpreter"
            ) from None
        try:
            devices = pyverbs.device.get_device_list()
        except Exception as exc:  # pyverbs raises its own error types when the RDMA stack is absent
            raise RdmaUnavailable(f"no RDMA devices: {exc}") from None
        if not devices:
            raise RdmaUnavailable("pyverbs found no RDMA devices")
        return cls(port_num=port_num, gid_index=gid_index)

    def open_nic(self, name: str) -> PyverbsNic:
        try:
            return PyverbsNic(name, self.port_num, self.gid_index)
        except Exception as exc:  # pyverbs errors are not OSError
            raise OSError(f"cannot open RDMA device {name}: {exc}") from exc


class PyverbsRegion:
    def __init__(self, mr: Any, addr: int, length: int, view: memoryview) -> None:
        self._mr = mr
        self._view = view  # keeps the registered memory exported while the region lives
        self.addr = addr
        self.length = length
        self.lkey: int = mr.lkey
        self.rkey: int = mr.rkey

    def close(self) -> None:
        self._mr.close()


class PyverbsNic:
    """Owns one device context and its protection domain."""

    def __init__(self, name: str, port_num: int, gid_index: int) -> None:
        from pyverbs.device import Context
        from pyverbs.pd import PD

        self.name = name
        self._port_num = port_num
        self._gid_index = gid_index
        self._context = Context(name=name)
        self._pd = PD(self._context)
        port = self._context.query_port(port_num)
        self.lid: int = port.lid
        self.path_mtu: int = port.active_mtu
        gid = str(self._context.query_gid(port_num, gid_index))
        self.gid = "" if gid.strip(":0") == "" else gid

    def register(self, view: memoryview, is_device: bool = False) -> PyverbsRegion:
        """Device memory registers the same way (by address) where nvidia-peermem lets the NIC map it."""
        import pyverbs.enums as e
        from pyverbs.mr import MR

        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
        addr = buffer_address(view)
        try:
            mr = MR(self._pd, view.nbytes, access, address=addr)
        except Exception as exc:
            where = "GPU memory (GPUDirect: is nvidia-peermem loaded?)" if is_device else "memory"
            raise OSError(f"{self.name}: registration of {view.nbytes} bytes of {where} failed: {exc}") from exc
        return PyverbsRegion(mr, addr, view.nbytes, view)

    def create_qp(self, max_send_wr: int) -> PyverbsQueuePair:
        import pyverbs.enums as e
        from pyverbs.cq import CQ
        from pyverbs.qp import QP, QPCap, QPInitAttr

        try:
            cq = CQ(self._context, max_send_wr * 2)
            cap = QPCap(max_send_wr=max_send_wr, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
            qp = QP(self._pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=1))
        except Exception as exc:
            raise OSError(f"{self.name}: queue pair creation failed: {exc}") from exc
        return PyverbsQueuePair(self, qp, cq)

    def close(self) -> None:
        self._pd.close()
        self._context.close()


class PyverbsQueuePair:
    """Owns one RC queue pair and its completion queue."""

    def __init__(self, nic: PyverbsNic, qp: Any, cq: Any) -> None:
        self._nic = nic
        self._qp = qp
        self._cq = cq
        self._psn = random.getrandbits(24)

    def info(self) -> QpInfo:
        return QpInfo(self._nic.name, self._qp.qp_num, self._nic.lid, self._nic.gid, self._psn)

    def connect(self, remote: QpInfo) -> None:
        try:
            self._connect(remote)
        except Exception as exc:
            raise OSError(f"{self._nic.name}: connecting to qp {remote.qp_num} on {remote.nic} failed: {exc}") from exc

    def _connect(self, remote: QpInfo) -> None:
        import pyverbs.enums as e
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        attr = QPAttr()
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
        attr.port_num = self._nic._port_num
        attr.path_mtu = self._nic.path_mtu
        attr.dest_qp_num = remote.qp_num
        attr.rq_psn = remote.psn
        attr.sq_psn = self._psn
        attr.max_dest_rd_atomic = 16
        attr.max_rd_atomic = 16
        attr.min_rnr_timer = 12
        attr.timeout = 14
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        if remote.gid:
            route = GlobalRoute(dgid=GID(remote.gid), sgid_index=self._nic._gid_index)
            attr.ah_attr = AHAttr(port_num=self._nic._port_num, is_global=1, grh=route, dlid=remote.lid)
        else:
            attr.ah_attr = AHAttr(port_num=self._nic._port_num, dlid=remote.lid)
        self._qp.to_init(attr)
        self._qp.to_rtr(attr)
        self._qp.to_rts(attr)

    def post(self, requests: Sequence[WorkRequest]) -> None:
        import pyverbs.enums as e
        from pyverbs.wr import SGE, SendWR

        for request in requests:
            opcode = e.IBV_WR_RDMA_WRITE if request.op is TransferOp.WRITE else e.IBV_WR_RDMA_READ
            sge = SGE(request.local_addr, request.length, request.lkey)
            wr = SendWR(wr_id=request.wr_id, opcode=opcode, num_sge=1, sg=[sge], send_flags=e.IBV_SEND_SIGNALED)
            wr.set_wr_rdma(request.rkey, request.remote_addr)
            try:
                self._qp.post_send(wr)
            except Exception as exc:
                raise OSError(f"{self._nic.name}: post_send failed: {exc}") from exc

    def poll(self, max_entries: int) -> list[Completion]:
        import pyverbs.enums as e

        try:
            _, completions = self._cq.poll(max_entries)
        except Exception as exc:
            raise OSError(f"{self._nic.name}: poll_cq failed: {exc}") from exc
        return [
            Completion(wc.wr_id, wc.status == e.IBV_WC_SUCCESS, e.ibv_wc_status(wc.status).name) for wc in completions
        ]

    def close(self) -> None:
        self._qp.close()
        self._cq.close()
