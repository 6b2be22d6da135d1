"""Transfer engine: registered segments, batched READ/WRITE over local memcpy, TCP and RDMA transports."""

from mooncaked.rdma.engine import TransferEngine
from mooncaked.rdma.topology import NicTiers, Topology, discover_topology
from mooncaked.rdma.types import (
    BatchState,
    BatchStatus,
    SegmentRef,
    TransferError,
    TransferOp,
    TransferRequest,
)

__all__ = [
    "BatchState",
    "BatchStatus",
    "NicTiers",
    "SegmentRef",
    "Topology",
    "TransferEngine",
    "TransferError",
    "TransferOp",
    "TransferRequest",
    "discover_topology",
]
