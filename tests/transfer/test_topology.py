"""Topology matrix from a fake sysfs tree and from config."""

from __future__ import annotations

from pathlib import Path

import pytest

from mooncaked.config.sections import ConfigError
from mooncaked.roles.base import make_transfer_engine
from mooncaked.transfer.nics import Nic, serving_tier
from mooncaked.transfer.topology import NicTiers, Topology, discover_topology, topology_from_nics
from tests.roles.cluster_fixtures import cluster_config, instance


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


def test_one_nic_list_gives_rdma_the_path_choice_tcp_makes() -> None:
    """A location prefers the RDMA devices of the NICs that serve it (transfer/nics.py serving_tier); a NIC that
    names no memory serves every location."""
    socket0 = Nic.parse("eth0", "10.0.0.1/24", numa_node=0, devices=["cuda:0"])
    socket1 = Nic.parse("eth1", "10.0.1.1/24", numa_node=1, devices=["cuda:1"])
    anywhere = Nic.parse("eth2", "10.0.2.1/24")
    topology = topology_from_nics([("mlx5_0", socket0), ("mlx5_1", socket1), ("mlx5_2", anywhere)])
    assert topology.matrix == {
        "cpu:0": NicTiers(("mlx5_0", "mlx5_2"), ("mlx5_1",)), "cpu:1": NicTiers(("mlx5_1", "mlx5_2"), ("mlx5_0",)),
        "cuda:0": NicTiers(("mlx5_0", "mlx5_2"), ("mlx5_1",)), "cuda:1": NicTiers(("mlx5_1", "mlx5_2"), ("mlx5_0",))}
    for location in topology.matrix:
        for device, nic in (("mlx5_0", socket0), ("mlx5_1", socket1), ("mlx5_2", anywhere)):
            assert topology.tier(location, device) == serving_tier(nic, location)
    assert topology.nics_for("cuda:7") == ["mlx5_0", "mlx5_1", "mlx5_2"]  # a location none names: every NIC


def test_a_hosts_rdma_devices_in_its_nic_list_reach_the_transfer_engine(tmp_path: Path) -> None:
    nics = {"127.0.0.1": [{"name": "nic0", "address": "127.0.0.1/8", "numa_node": 0, "rdma_device": "mlx5_0"},
                          {"name": "nic1", "address": "127.0.0.2/8", "numa_node": 1, "rdma_device": "mlx5_1"}]}
    config = cluster_config(tmp_path, [instance("s0", "store")], transfer={"nics": nics})
    engine = make_transfer_engine(config, "127.0.0.1", 0)
    assert engine.options.topology == Topology({"cpu:0": NicTiers(("mlx5_0",), ("mlx5_1",)),
                                                "cpu:1": NicTiers(("mlx5_1",), ("mlx5_0",))})
    with pytest.raises(ConfigError, match="keep one"):
        cluster_config(tmp_path, [instance("s0", "store")],
                       transfer={"nics": nics, "topology": {"cpu:0": {"preferred": ["mlx5_0"], "secondary": []}}})
    twice = {"127.0.0.1": [{**entry, "rdma_device": "mlx5_0"} for entry in nics["127.0.0.1"]]}
    with pytest.raises(ConfigError, match="two NICs with one rdma_device"):
        cluster_config(tmp_path, [instance("s0", "store")], transfer={"nics": twice})
