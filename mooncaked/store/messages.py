"""The store's RPC messages and methods (docs/design.md section 6). Bulk bytes never ride here: only keys, offsets, ids.

1. A writer calls ALLOCATE (write handles for absent keys, one read lease on present ones), writes each handle's
   bytes into the store's pool (shared memory or the transfer engine), then COMMIT (or ABORT).
2. A reader calls LOOKUP with `lease_ms` > 0 (longest present prefix, promoted to DRAM, leased), reads the
   blocks at their offsets, then RELEASE.
3. PIN/UNPIN keep a prefix (context cache) with a TTL; STATS also tells clients where the pool lives.
4. A conductor calls DUMP (server-streaming chunks of every present key, all as of one sequence number), then
   EVENTS after that number; a gap in sequence numbers (or a `not_found` error from EVENTS) means: dump again.
5. A conductor under `scheduler.replication: by_reuse` calls MARK_SPARE, in the background, with the keys whose
   copy here another store keeps (spare: evicted first) and those whose copy is kept again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mooncaked.rpc import Message, Method


@dataclass(frozen=True)
class WriteHandle(Message):
    """Write `num_bytes` at `offset` of the store's pool, then commit `handle_id`."""

    handle_id: int
    key: bytes
    offset: int
    num_bytes: int
    incarnation: int = 0  # the store's run that granted `offset` (StatsReply.incarnation); 0: unchecked


@dataclass(frozen=True)
class BlockLocation(Message):
    key: bytes
    tier: str  # "dram" | "ssd"
    offset: int  # pool offset when tier is "dram", else -1
    num_bytes: int
    incarnation: int = 0  # the store's run that `offset` belongs to; 0: unchecked


@dataclass(frozen=True)
class AllocateRequest(Message):
    keys: list[bytes]
    num_bytes: int  # every object of one call has the same size (one model's block)
    lease_ms: int
    first_position: int = 0  # position of keys[0] within its request (length-aware eviction)
    tenant: str = ""  # the writer's tenant: it owns the new blocks ("" for none)
    pool_share: float = 0.0  # the tenant's cap on this store (0: none) and its floor (kv/tenant_quota.py)
    min_pool_share: float = 0.0


@dataclass(frozen=True)
class AllocateReply(Message):
    handles: list[WriteHandle]  # absent keys, in request order
    present: list[BlockLocation]  # present keys (DRAM after promotion), in request order
    read_lease_id: int  # 0 when no key was present


@dataclass(frozen=True)
class CommitRequest(Message):
    handle_ids: list[int]


@dataclass(frozen=True)
class CommitReply(Message):
    num_committed: int
    num_duplicates: int  # keys another writer committed first; their space was freed


@dataclass(frozen=True)
class AbortRequest(Message):
    handle_ids: list[int]


@dataclass(frozen=True)
class AbortReply(Message):
    num_aborted: int


@dataclass(frozen=True)
class LookupRequest(Message):
    keys: list[bytes]
    lease_ms: int = 0  # > 0: lease the prefix for reading (and promote it from SSD to DRAM)


@dataclass(frozen=True)
class LookupReply(Message):
    locations: list[BlockLocation]  # the longest present prefix
    read_lease_id: int


@dataclass(frozen=True)
class ReleaseRequest(Message):
    lease_ids: list[int]


@dataclass(frozen=True)
class ReleaseReply(Message):
    num_released: int


@dataclass(frozen=True)
class PinRequest(Message):
    keys: list[bytes]
    ttl_ms: int


@dataclass(frozen=True)
class PinReply(Message):
    missing_keys: list[bytes]


@dataclass(frozen=True)
class UnpinRequest(Message):
    keys: list[bytes]


@dataclass(frozen=True)
class UnpinReply(Message):
    num_unpinned: int


@dataclass(frozen=True)
class StatsRequest(Message):
    pass


@dataclass(frozen=True)
class StatsReply(Message):
    counters: dict[str, int]
    pool_path: str  # same-host clients map this file
    pool_bytes: int
    segment_endpoint: str  # transfer-engine endpoint "host:port" of the pool
    segment_name: str
    host: str  # host identity: a client on the same host may map the pool instead of using the network
    incarnation: int = 0  # this run of the store: pool offsets of another run must never be used


@dataclass(frozen=True)
class StoreEventMessage(Message):
    seq: int
    kind: str  # "stored" | "removed"
    key: bytes


@dataclass(frozen=True)
class EventsRequest(Message):
    after_seq: int
    max_batch: int = 4096


@dataclass(frozen=True)
class EventBatch(Message):
    events: list[StoreEventMessage]


@dataclass(frozen=True)
class DumpRequest(Message):
    max_chunk_keys: int = 65536


@dataclass(frozen=True)
class DumpChunk(Message):
    seq: int  # the dump reflects every event up to and including this one
    keys: list[bytes] = field(default_factory=list)
    is_last: bool = True


@dataclass(frozen=True)
class MarkSpareRequest(Message):
    spare_keys: list[bytes]  # another store keeps a copy: give this one back first
    kept_keys: list[bytes]  # kept again (the other copy is gone, or the block turned hot)


@dataclass(frozen=True)
class MarkSpareReply(Message):
    num_marked: int  # keys of either list present in DRAM here (the others are ignored)


ALLOCATE = Method("store.allocate", AllocateRequest, AllocateReply)
COMMIT = Method("store.commit", CommitRequest, CommitReply)
ABORT = Method("store.abort", AbortRequest, AbortReply)
LOOKUP = Method("store.lookup", LookupRequest, LookupReply)
RELEASE = Method("store.release", ReleaseRequest, ReleaseReply)
PIN = Method("store.pin", PinRequest, PinReply)
UNPIN = Method("store.unpin", UnpinRequest, UnpinReply)
STATS = Method("store.stats", StatsRequest, StatsReply)
EVENTS = Method("store.events", EventsRequest, EventBatch, is_streaming=True)
DUMP = Method("store.dump", DumpRequest, DumpChunk, is_streaming=True)
MARK_SPARE = Method("store.mark_spare", MarkSpareRequest, MarkSpareReply)

STORE_METHODS = (ALLOCATE, COMMIT, ABORT, LOOKUP, RELEASE, PIN, UNPIN, STATS, EVENTS, DUMP, MARK_SPARE)
