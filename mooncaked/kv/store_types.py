"""Plain value types of the store core: tiers, grants, locations, evictions, its config and key checks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mooncaked.kv.keys import KEY_BYTES

TIER_DRAM = "dram"
TIER_SSD = "ssd"


class StoreFull(Exception):
    """The absent keys of an allocation do not fit even after evicting everything evictable."""


class UnknownHandle(KeyError):
    """A handle id that is not outstanding (never issued, already committed or aborted, or expired)."""


@dataclass(frozen=True)
class Grant:
    """A write handle: write `num_bytes` at `offset` in the pool, then commit `handle_id`."""

    handle_id: int
    key: bytes
    offset: int
    num_bytes: int


@dataclass(frozen=True)
class Location:
    key: bytes
    tier: str  # TIER_DRAM | TIER_SSD
    offset: int  # pool offset in DRAM; -1 on SSD
    num_bytes: int


@dataclass(frozen=True)
class Eviction:
    """A block leaving DRAM for SSD: its bytes are pool[offset:offset+num_bytes] until the eviction returns."""

    key: bytes
    offset: int
    num_bytes: int


Spill = Callable[[Eviction], bool]  # takes a block's bytes for SSD now; False: the SSD tier cannot take it


@dataclass
class PendingWrite:
    """An outstanding write handle (state of the StoreCore's WriteHandles, write_handles.py)."""

    grant: Grant
    deadline: float
    position: int
    tenant: str = ""  # the writer's tenant: it will own the block


@dataclass
class BlockRecord:
    """A committed block: in DRAM at `dram_offset`, on SSD, or both (state of the StoreCore). A block whose SSD copy
    is still queued for writing is served from the SSD tier's memory until it is written (or dropped)."""

    num_bytes: int
    dram_offset: int | None
    is_on_ssd: bool
    position: int
    num_readers: int = 0
    pinned_until: float = 0.0
    last_used: float = 0.0  # `now` of its commit, promotion, last lookup or read lease
    tenant: str = ""  # the tenant whose write made it ("" for none: shared, or found on SSD at start)
    is_ssd_durable: bool = False  # its SSD copy (is_on_ssd: queued or written) is written and fsync'd


@dataclass
class ReadLease:
    """Keys a reader holds against eviction until `deadline` (state of the StoreCore)."""

    keys: list[bytes]
    deadline: float


@dataclass(frozen=True)
class StoreConfig:
    capacity_bytes: int
    alignment: int = 4096
    eviction_policy: str = "lru"
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    has_ssd: bool = False
    max_events: int = 1 << 16
    first_id: int = 1  # of handles and leases: a restarted store starts elsewhere, so no old id names a new one


def check_keys(keys: Sequence[bytes]) -> None:
    """Raise ValueError naming the first key that is not a distinct 16-byte block key."""
    for index, key in enumerate(keys):
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise ValueError(f"keys[{index}] must be {KEY_BYTES} bytes (see kv/keys.py), got {key!r:.60}")
    if len(set(keys)) != len(keys):
        raise ValueError("keys must be distinct within one call")


def check_lease_ms(lease_ms: int) -> None:
    if lease_ms <= 0:
        raise ValueError(f"lease_ms must be positive, got {lease_ms}")
