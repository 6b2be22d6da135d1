"""Transfer engine: registered segments, batched READ/WRITE over local memcpy, TCP and RDMA transports."""

from mooncaked.rdma.control import QpExchange
from mooncaked.rdma.engine import TransferEngine
from mooncaked.rdma.options import TransferOptions
from mooncaked.rdma.topology import NicTiers, Topology, discover_topology
from mooncaked.rdma.types import (
    BatchState,
    BatchStatus,
    SegmentRef,
    TransferError,
    TransferOp,
    TransferRequest,
)
from mooncaked.rdma.verbs import RdmaUnavailable

__all__ = [
    "BatchState",
    "BatchStatus",
    "NicTiers",
    "QpExchange",
    "RdmaUnavailable",
    "SegmentRef",
    "Topology",
    "TransferEngine",
    "TransferError",
    "TransferOp",
    "TransferOptions",
    "TransferRequest",
    "discover_topology",
]
