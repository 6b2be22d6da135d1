"""Topology matrix from a fake sysfs tree and from config."""

from __future__ import annotations

from pathlib import Path

import pytest

from mooncaked.transfer.topology import NicTiers, Topology, discover_topology


def add_pci_device(root: Path, pci_path: str, numa_node: int, pci_class: str = "", vendor: str = "") -> Path:
    device = root / "devices" / pci_path
    device.mkdir(parents=True)
    (device / "numa_node").write_text(f"{numa_node}\n")
    if pci_class:
        (device / "class").write_text(pci_class + "\n")
        (device / "vendor").write_text(vendor + "\n")
        bus = root / "bus" / "pci" / "devices"
        bus.mkdir(parents=True, exist_ok=True)
        (bus / device.name).symlink_to(device)
    return device


def add_nic(root: Path, name: str, pci_path: str, numa_node: int) -> None:
    device = add_pci_device(root, pci_path, numa_node)
    entry = root / "class" / "infiniband" / name
    entry.mkdir(parents=True)
    (entry / "device").symlink_to(device)


@pytest.fixture
def two_socket_host(tmp_path: Path) -> Path:
    for node in (0, 1):
        (tmp_path / "devices" / "system" / "node" / f"node{node}").mkdir(parents=True)
    add_nic(tmp_path, "mlx5_0", "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0", 0)
    add_nic(tmp_path, "mlx5_1", "pci0000:80/0000:80:01.0/0000:81:00.0", 1)
    add_nic(tmp_path, "mlx5_2", "pci0000:80/0000:80:03.0/0000:83:00.0", 1)
    add_pci_device(tmp_path, "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0", 0, "0x030200", "0x10de")
    add_pci_device(tmp_path, "pci0000:80/0000:80:02.0/0000:82:00.0", 1, "0x030000", "0x10de")
    add_pci_device(tmp_path, "pci0000:00/0000:00:1f.0/0000:03:00.0", 0, "0x030000", "0x1a03")  # BMC VGA
    return tmp_path


def test_discovery_prefers_numa_for_cpu_and_switch_for_gpu(two_socket_host: Path) -> None:
    topology = discover_topology(two_socket_host)
    assert topology.matrix == {
        "cpu:0": NicTiers(("mlx5_0",), ("mlx5_1", "mlx5_2")),
        "cpu:1": NicTiers(("mlx5_1", "mlx5_2"), ("mlx5_0",)),
        "cuda:0": NicTiers(("mlx5_0",), ("mlx5_1", "mlx5_2")),  # same PCIe switch
        "cuda:1": NicTiers(("mlx5_1", "mlx5_2"), ("mlx5_0",)),  # no shared switch: its NUMA node
    }
    assert topology.nics == ["mlx5_0", "mlx5_1", "mlx5_2"]
    assert topology.tier("cuda:0", "mlx5_0") == 0 and topology.tier("cuda:0", "mlx5_2") == 1
    assert topology.nics_for("cpu:1") == ["mlx5_1", "mlx5_2", "mlx5_0"]


def test_unknown_numa_node_makes_a_nic_preferred_everywhere(tmp_path: Path) -> None:
    add_nic(tmp_path, "rxe0", "pci0000:00/0000:00:03.0", -1)
    topology = discover_topology(tmp_path)
    assert topology.matrix == {"cpu:0": NicTiers(("rxe0",), ())}


def test_host_without_rdma_has_no_nics(tmp_path: Path) -> None:
    assert discover_topology(tmp_path).nics == []


def test_config_forms_round_trip(two_socket_host: Path) -> None:
    topology = discover_topology(two_socket_host)
    assert Topology.from_config(topology.to_config()) == topology
    mooncake_form = Topology.from_config({"cpu:0": [["mlx5_0"], ["mlx5_1", "mlx5_0"]]})
    assert mooncake_form.matrix["cpu:0"] == NicTiers(("mlx5_0",), ("mlx5_1",))
    with pytest.raises(ValueError, match=r"topology\['cpu:0'\]: unknown keys \['prefered'\]"):
        Topology.from_config({"cpu:0": {"prefered": ["mlx5_0"]}})
