"""Transfer engine: registered segments, batched READ/WRITE over local memcpy, TCP and RDMA transports."""

from mooncaked.transfer.control import QpExchange
from mooncaked.transfer.engine import TransferEngine
from mooncaked.transfer.options import TransferOptions
from mooncaked.transfer.topology import NicTiers, Topology, discover_topology
from mooncaked.transfer.types import (
    BatchState,
    BatchStatus,
    SegmentRef,
    TransferError,
    TransferOp,
    TransferRequest,
)
from mooncaked.transfer.verbs import RdmaUnavailable

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
