"""Tuning options of one transfer engine (slicing, paths, retries, timeouts, RDMA limits); immutable."""

from __future__ import annotations

from dataclasses import dataclass

from mooncaked.transfer.nics import Nic
from mooncaked.transfer.topology import Topology

KNOWN_TRANSPORTS = ("local", "tcp", "rdma")


@dataclass(frozen=True)
class TransferOptions:
    transports: tuple[str, ...] = ("local", "tcp")
    slice_bytes: int = 64 * 1024
    num_connections_per_peer: int = 4
    max_retries: int = 3
    path_cooldown_s: float = 5.0
    path_failure_threshold: int = 2  # consecutive failures before a path cools down
    # Most bytes (whole slices) one TCP frame carries. Each frame costs a header, a reply and a queue hand-off;
    # at 16 MiB a 64 MiB request is one frame per connection (of 4), and a failed frame retries only 16 MiB.
    tcp_frame_bytes: int = 16 << 20
    # SO_SNDBUF of every data connection, both sides (0: kernel autotuning, up to tcp_wmem's max, 4 MiB here).
    # A small send buffer keeps the bytes between the sender's copy-in and the receiver's copy-out in the CPU
    # caches: on loopback 256 KiB cut CPU per GiB by 10-20% (`mooncaked bench transfer`); the kernel doubles it,
    # so ~512 KiB stay in flight per connection, enough for a datacenter round trip at several GB/s.
    tcp_send_buffer_bytes: int = 256 << 10
    connect_timeout_s: float = 2.0
    io_timeout_s: float = 10.0  # a socket operation or an RDMA run stuck this long fails its path
    idle_timeout_s: float = 300.0  # a data connection idle this long is closed by its server (its client reconnects)
    stop_timeout_s: float = 5.0
    topology: Topology | None = None  # None: discovered from sysfs_root
    sysfs_root: str = "/sys"
    max_endpoints: int = 256  # RDMA queue pairs kept, active and passive together (SIEVE beyond)
    rdma_slices_per_run: int = 16  # work requests one path posts before polling
    rdma_max_send_wr: int = 64
    nics: tuple[Nic, ...] = ()  # this host's NICs for TCP transfers (nics.py); empty: the engine's host only

    def __post_init__(self) -> None:
        unknown = [t for t in self.transports if t not in KNOWN_TRANSPORTS]
        if unknown or not self.transports:
            raise ValueError(
                f"transports must be a non-empty subset of {KNOWN_TRANSPORTS}, got {list(self.transports)}"
            )
        for name in ("slice_bytes", "num_connections_per_peer", "path_failure_threshold", "tcp_frame_bytes",
                     "max_endpoints", "rdma_slices_per_run"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tcp_send_buffer_bytes < 0:
            raise ValueError(
                f"tcp_send_buffer_bytes must be >= 0 (0: kernel default), got {self.tcp_send_buffer_bytes}"
            )
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if not 0 < self.io_timeout_s < self.idle_timeout_s:
            raise ValueError(f"0 < io_timeout_s < idle_timeout_s is required, got {self.io_timeout_s} and "
                             f"{self.idle_timeout_s}")
        names = [nic.name for nic in self.nics]
        if len(set(names)) < len(names) or len({nic.address for nic in self.nics}) < len(names):
            raise ValueError(f"NIC names and addresses must be unique, got {[nic.text for nic in self.nics]}")
        if self.rdma_max_send_wr < self.rdma_slices_per_run:
            raise ValueError("rdma_max_send_wr must be >= rdma_slices_per_run (one run is posted at once)")
