"""Where a worker's KV memory sits, as the transfer engine sees it: the location that picks the NICs.

1. `staging_placement(device, sysfs_root, allowed_nodes)`: for a GPU, host staging is pinned on the GPU's NUMA
   node (bound there when this process may allocate there) and registered as "cpu:N", so staged moves use the
   NICs of that node; on CPU, "cpu:0" (unbound).
2. `register_kv_pages(engine, name, pages, device)`: on CUDA with RDMA active, the KV pages (one allocation)
   register as "cuda:N", so peers' RDMA reaches them (GPUDirect) through the NICs under the GPU's PCIe switch.
   Where RDMA is off, or a NIC cannot map GPU memory, nothing is registered and KV moves stay staged.
GPU numbering follows the topology's (PCI address order): run with CUDA_DEVICE_ORDER=PCI_BUS_ID.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from mooncaked.transfer import TransferEngine
from mooncaked.transfer.segments import DEFAULT_LOCATION
from mooncaked.transfer.topology import gpu_numa_node

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StagingPlacement:
    numa_node: int | None  # where staging pages are bound (None: wherever they are first touched)
    location: str  # the staging segments' location for NIC choice


def staging_placement(device: torch.device, sysfs_root: str, allowed_nodes: set[int]) -> StagingPlacement:
    if device.type != "cuda":
        return StagingPlacement(None, DEFAULT_LOCATION)
    node = gpu_numa_node(device.index or 0, sysfs_root)
    if node is None or node not in allowed_nodes:
        return StagingPlacement(None, DEFAULT_LOCATION)
    return StagingPlacement(node, f"cpu:{node}")


def register_kv_pages(engine: TransferEngine, name: str, pages: torch.Tensor, device: torch.device) -> bool:
    """True when `pages` (the KV pages' one buffer) became a "cuda:N" segment; False: moves stay staged."""
    if device.type != "cuda" or engine.rdma is None:
        return False
    location = f"cuda:{device.index or 0}"
    try:
        engine.register_device(name, pages.data_ptr(), pages.numel() * pages.element_size(), location, pages)
    except (OSError, ValueError) as exc:
        logger.info("KV pages on %s not registered for GPUDirect RDMA (%s): KV moves are staged through pinned "
                    "host memory", location, exc)
        return False
    logger.info("KV pages registered at %s for GPUDirect RDMA", location)
    return True
