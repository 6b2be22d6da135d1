"""Topology matrix: for each memory location on a host, its preferred and secondary RDMA NICs.

1. `discover_topology(sysfs_root)` lists NICs (class/infiniband/*, their PCI device and NUMA node), CPU NUMA
   nodes (devices/system/node/node*) and NVIDIA GPUs (bus/pci/devices/* with class 0x0300/0x0302 and vendor
   0x10de, numbered in PCI address order as cuda:0, cuda:1, ...).
2. `cpu:N` prefers the NICs on NUMA node N; `cuda:N` prefers the NICs under the same PCIe switch (a shared
   bridge below the root complex), else those on its NUMA node. Every other NIC is secondary.
3. `Topology.from_config` takes the same matrix from config, as {"cpu:0": {"preferred": [...], "secondary": [...]}}
   or Mooncake's {"cpu:0": [[preferred...], [secondary...]]}; `to_config` writes the first form.
4. Path choice ranks a (local NIC, remote NIC) pair by `tier` on both ends (0 = preferred, 1 = secondary).
5. `topology_from_nics`: the matrix from a host's NIC list (`transfer.nics` entries that name an `rdma_device`),
   so one list drives both transports' path choice: a location prefers the RDMA devices of the NICs that serve it
   (transfer/nics.py `serving_tier`, as TCP does), every other one is secondary.
6. Memory placement asks the same tree where things are: `nic_numa_node` (a store binds its pool there by
   default) and `gpu_numa_node` (where a GPU's pinned staging buffers belong).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mooncaked.transfer.nics import Nic, serving_tier

_GPU_CLASSES = ("0x0300", "0x0302")
_NVIDIA_VENDOR = "0x10de"


@dataclass(frozen=True)
class NicTiers:
    preferred: tuple[str, ...]
    secondary: tuple[str, ...]


@dataclass(frozen=True)
class Topology:
    """One host's matrix, location -> NicTiers; immutable once built."""

    matrix: Mapping[str, NicTiers] = field(default_factory=dict)

    @property
    def nics(self) -> list[str]:
        names = {nic for tiers in self.matrix.values() for nic in (*tiers.preferred, *tiers.secondary)}
        return sorted(names)

    def tier(self, location: str, nic: str) -> int:
        """0 when `nic` is preferred for `location`, 1 otherwise (also for a location the matrix lacks)."""
        tiers = self.matrix.get(location)
        return 0 if tiers is not None and nic in tiers.preferred else 1

    def nics_for(self, location: str) -> list[str]:
        """Preferred NICs first, then secondary ones."""
        tiers = self.matrix.get(location)
        if tiers is None:
            return self.nics
        return [*tiers.preferred, *tiers.secondary]

    def to_config(self) -> dict[str, dict[str, list[str]]]:
        return {
            location: {"preferred": list(t.preferred), "secondary": list(t.secondary)}
            for location, t in self.matrix.items()
        }

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Topology:
        return cls({location: _parse_tiers(location, entry) for location, entry in config.items()})


def _parse_tiers(location: str, entry: Any) -> NicTiers:
    if isinstance(entry, Mapping):
        unknown = set(entry) - {"preferred", "secondary"}
        if unknown:
            raise ValueError(f"topology[{location!r}]: unknown keys {sorted(unknown)}; use preferred/secondary")
        preferred, secondary = entry.get("preferred", []), entry.get("secondary", [])
    elif isinstance(entry, (list, tuple)) and len(entry) == 2:
        preferred, secondary = entry
    else:
        raise ValueError(f"topology[{location!r}] must be {{preferred: [...], secondary: [...]}} or [[...], [...]]")
    if not all(isinstance(nic, str) for nic in (*preferred, *secondary)):
        raise ValueError(f"topology[{location!r}]: NIC names must be strings")
    return NicTiers(tuple(preferred), tuple(nic for nic in secondary if nic not in preferred))


@dataclass(frozen=True)
class PciDevice:
    name: str
    numa_node: int  # -1 when the kernel does not know
    bridges: tuple[str, ...]  # PCI path below /sys/devices, root complex first, the device itself last


def topology_from_nics(nics: Sequence[tuple[str, Nic]]) -> Topology:
    """(RDMA device, its NIC) pairs -> the matrix over every location one of them names (cpu:<numa_node>, each
    listed device); a location none names has no row (every NIC secondary there, Topology.tier)."""
    locations = sorted({f"cpu:{nic.numa_node}" for _, nic in nics if nic.numa_node is not None}
                       | {device for _, nic in nics for device in nic.devices})
    names = [device for device, _ in nics]
    matrix = {}
    for location in locations:
        preferred = [device for device, nic in nics if serving_tier(nic, location) == 0]
        matrix[location] = NicTiers(tuple(preferred), tuple(name for name in names if name not in preferred))
    return Topology(matrix)


def discover_topology(sysfs_root: str | os.PathLike[str] = "/sys") -> Topology:
    root = Path(sysfs_root)
    nics = _discover_nics(root)
    matrix: dict[str, NicTiers] = {}
    for node in _discover_numa_nodes(root):
        preferred = [nic.name for nic in nics if nic.numa_node in (node, -1)]
        matrix[f"cpu:{node}"] = _tiers(preferred, nics)
    for index, gpu in enumerate(_discover_gpus(root)):
        preferred = [nic.name for nic in nics if _shares_switch(gpu, nic)]
        if not preferred:
            preferred = [nic.name for nic in nics if nic.numa_node == gpu.numa_node]
        matrix[f"cuda:{index}"] = _tiers(preferred, nics)
    return Topology(matrix)


def nic_numa_node(sysfs_root: str | os.PathLike[str] = "/sys") -> int | None:
    """The NUMA node of the first RDMA NIC (in name order) whose node is known; None without one."""
    return next((nic.numa_node for nic in _discover_nics(Path(sysfs_root)) if nic.numa_node >= 0), None)


def gpu_numa_node(index: int, sysfs_root: str | os.PathLike[str] = "/sys") -> int | None:
    """The NUMA node of GPU `cuda:index` (PCI address order, as in the matrix); None when unknown."""
    gpus = _discover_gpus(Path(sysfs_root))
    if not 0 <= index < len(gpus) or gpus[index].numa_node < 0:
        return None
    return gpus[index].numa_node


def _tiers(preferred: list[str], nics: list[PciDevice]) -> NicTiers:
    if not preferred:
        preferred = [nic.name for nic in nics]
    return NicTiers(tuple(preferred), tuple(nic.name for nic in nics if nic.name not in preferred))


def _shares_switch(a: PciDevice, b: PciDevice) -> bool:
    """True when both hang below the same root port or switch (a common bridge besides the root complex)."""
    common = 0
    for left, right in zip(a.bridges[:-1], b.bridges[:-1]):
        if left != right:
            break
        common += 1
    return common >= 2


def _discover_nics(root: Path) -> list[PciDevice]:
    class_dir = root / "class" / "infiniband"
    if not class_dir.is_dir():
        return []
    return [_pci_device(entry.name, entry / "device", root) for entry in sorted(class_dir.iterdir())]


def _discover_numa_nodes(root: Path) -> list[int]:
    node_dir = root / "devices" / "system" / "node"
    nodes = sorted(
        int(entry.name[4:])
        for entry in (node_dir.iterdir() if node_dir.is_dir() else [])
        if entry.name.startswith("node") and entry.name[4:].isdigit()
    )
    return nodes or [0]


def _discover_gpus(root: Path) -> list[PciDevice]:
    pci_dir = root / "bus" / "pci" / "devices"
    if not pci_dir.is_dir():
        return []
    gpus = []
    for entry in sorted(pci_dir.iterdir()):
        pci_class, vendor = _read(entry / "class"), _read(entry / "vendor")
        if vendor == _NVIDIA_VENDOR and pci_class[:6] in _GPU_CLASSES:
            gpus.append(_pci_device(entry.name, entry, root))
    return gpus


def _pci_device(name: str, device_link: Path, root: Path) -> PciDevice:
    real = Path(os.path.realpath(device_link))
    devices_root = Path(os.path.realpath(root / "devices"))
    try:
        bridges = real.relative_to(devices_root).parts
    except ValueError:
        bridges = real.parts
    numa_text = _read(real / "numa_node")
    numa_node = int(numa_text) if numa_text.lstrip("-").isdigit() else -1
    return PciDevice(name, numa_node, tuple(bridges))


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""
