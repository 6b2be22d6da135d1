"""StoreClient: what prefill and decode workers use to put and get KV blocks in one host's store.

1. `await StoreClient.connect(rpc, host=..., pool_path=..., engine=...)` asks the store about its pool (STATS).
   On the store's host it maps the pool's shared-memory file (moves are memcpy): the file at `pool_path`, which
   the caller derives from its own config (shm_pool.pool_path), only when the store names that same path and
   the file passes ShmPool.attach's checks (a regular file of this user, no link, the size the store reports);
   never a path a peer names. Elsewhere, or when refused, it needs a TransferEngine and moves bytes with
   READ/WRITE on the store's segment.
2. `register_staging(name, buffer)` makes a CPU buffer (bytearray, numpy array, CPU tensor) usable as the other
   end of moves; with an engine it is registered there as a segment.
3. Put: `allocate(keys, block_bytes, lease_ms)` → `write_layer(...)` per layer (or `write_blocks`) → `commit`.
   Get: `lookup(keys, lease_ms)` → `read_blocks(...)` (or `read_layer`) → `release([lease_id])`.
4. `close()` unmaps the pool and unregisters staging segments; the RPC client and engine are the caller's.
5. A store that restarted has a new pool (a new file at the same path on its host, a new segment name) and a new
   incarnation. Every move names the incarnation its offsets came from (handles and locations carry it): a move
   of the current one proceeds, after mapping the new pool file or learning the new segment where needed; a
   move with an earlier run's offsets raises StaleOffsets and touches no byte, so a worker keeps working across
   a store restart and never reads or writes another run's blocks.

A block is `[layer][plane: k|v, or one MLA latent][token][kv_head][head_dim]`; one layer's slice is `layer_bytes` long at
`layer_index * layer_bytes` inside the block (docs/design.md section 5). The ends of a move and its spans: move_ends.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any, Protocol

import numpy as np

from mooncaked.kv.tenant_quota import TenantShare
from mooncaked.rpc import Message, Method
from mooncaked.store import messages as msg
from mooncaked.store.move_ends import LocalEnd, Span, Staging, staging_bytes
from mooncaked.store.shm_pool import PoolFileRefused, ShmPool, attach_local
from mooncaked.transfer import SegmentRef, TransferEngine, TransferError, TransferOp, TransferRequest

logger = logging.getLogger(__name__)

_THREAD_COPY_BYTES = 4 << 20  # local copies at least this large run off the event loop


class StaleOffsets(TransferError):
    """The offsets of a move were granted by an earlier run of a store that has restarted since."""


class RpcCaller(Protocol):
    """The part of mooncaked.rpc.RpcClient the store client uses."""

    async def call(self, method: Any, request: Any, *, timeout_s: float) -> Any: ...

    def stream(self, method: Any, request: Any, *, timeout_s: float) -> AsyncIterator[Any]: ...


class StoreClient:
    """One worker's connection to one store. Owns its pool mapping and staging registrations."""

    def __init__(self, rpc: RpcCaller, *, pool: ShmPool | None, engine: TransferEngine | None,
                 segment: SegmentRef, timeout_s: float = 30.0, incarnation: int = 0) -> None:
        if pool is None and engine is None:
            raise ValueError("the store is on another host: pass a started TransferEngine to move bytes")
        self.rpc = rpc
        self.pool = pool
        self.engine = engine
        self.segment = segment
        self.timeout_s = timeout_s
        self.incarnation = incarnation  # of the store run whose pool `pool` / `segment` is
        self._staging_names: list[str] = []
        self._refresh_lock = asyncio.Lock()

    @classmethod
    async def connect(cls, rpc: RpcCaller, *, host: str, pool_path: str | None, engine: TransferEngine | None = None,
                      is_shm_allowed: bool = True, timeout_s: float = 30.0) -> StoreClient:
        """Map the pool at `pool_path` when the store reports the same `host` and that path (see the module
        docstring), else use `engine`; `pool_path` None: never map."""
        stats: msg.StatsReply = await rpc.call(msg.STATS, msg.StatsRequest(), timeout_s=timeout_s)
        pool = None
        if is_shm_allowed and pool_path is not None and stats.host == host:
            pool = attach_local(pool_path, reported_path=stats.pool_path, reported_bytes=stats.pool_bytes,
                                is_required=engine is None)
        segment = SegmentRef(stats.segment_endpoint, stats.segment_name)
        return cls(rpc, pool=pool, engine=engine, segment=segment, timeout_s=timeout_s,
                   incarnation=stats.incarnation)

    @property
    def is_local(self) -> bool:
        return self.pool is not None

    async def close(self) -> None:
        if self.engine is not None:
            for name in self._staging_names:
                self.engine.unregister(name)
        self._staging_names.clear()
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    # ---- metadata calls -----------------------------------------------------------------------------------
    async def allocate(self, keys: Sequence[bytes], block_bytes: int, lease_ms: int, first_position: int = 0,
                       tenant: str = "", share: TenantShare | None = None) -> msg.AllocateReply:
        """`tenant` owns the new blocks within `share` of the store (kv/tenant_quota.py)."""
        share = share or TenantShare()
        request = msg.AllocateRequest(list(keys), block_bytes, lease_ms, first_position, tenant, share.pool_share,
                                      share.min_pool_share)
        reply: msg.AllocateReply = await self._call(msg.ALLOCATE, request)
        return reply

    async def commit(self, handle_ids: Sequence[int]) -> msg.CommitReply:
        reply: msg.CommitReply = await self._call(msg.COMMIT, msg.CommitRequest(list(handle_ids)))
        return reply

    async def abort(self, handle_ids: Sequence[int]) -> int:
        reply: msg.AbortReply = await self._call(msg.ABORT, msg.AbortRequest(list(handle_ids)))
        return reply.num_aborted

    async def lookup(self, keys: Sequence[bytes], lease_ms: int = 0) -> msg.LookupReply:
        """Longest present prefix; with `lease_ms` > 0 it is in DRAM and leased until `release`."""
        reply: msg.LookupReply = await self._call(msg.LOOKUP, msg.LookupRequest(list(keys), lease_ms))
        return reply

    async def release(self, lease_ids: Sequence[int]) -> int:
        reply: msg.ReleaseReply = await self._call(msg.RELEASE, msg.ReleaseRequest(list(lease_ids)))
        return reply.num_released

    async def pin(self, keys: Sequence[bytes], ttl_ms: int) -> list[bytes]:
        """Pin present keys for `ttl_ms`; returns the keys that were not present."""
        reply: msg.PinReply = await self._call(msg.PIN, msg.PinRequest(list(keys), ttl_ms))
        return reply.missing_keys

    async def unpin(self, keys: Sequence[bytes]) -> int:
        reply: msg.UnpinReply = await self._call(msg.UNPIN, msg.UnpinRequest(list(keys)))
        return reply.num_unpinned

    async def mark_spare(self, spare_keys: Sequence[bytes], kept_keys: Sequence[bytes]) -> int:
        reply = await self._call(msg.MARK_SPARE, msg.MarkSpareRequest(list(spare_keys), list(kept_keys)))
        return int(reply.num_marked)

    async def stats(self) -> msg.StatsReply:
        reply: msg.StatsReply = await self._call(msg.STATS, msg.StatsRequest())
        return reply

    async def dump(self) -> tuple[int, list[bytes]]:
        """(sequence number, every present key as of it)."""
        seq, keys = 0, []
        async for chunk in self.rpc.stream(msg.DUMP, msg.DumpRequest(), timeout_s=self.timeout_s):
            seq = chunk.seq
            keys.extend(chunk.keys)
        return seq, keys

    # ---- data moves ---------------------------------------------------------------------------------------
    def register_staging(self, name: str, buffer: Any) -> Staging:
        """Make `buffer` (contiguous CPU memory) the local end of moves; `name` must be unique in the engine."""
        if self.engine is not None and self.pool is None:
            self.engine.register(name, buffer)
            self._staging_names.append(name)
        return Staging(name, staging_bytes(buffer))

    def unregister_staging(self, staging: Staging) -> None:
        """End `staging`'s registration (a request's buffer, once its moves are done)."""
        if staging.name in self._staging_names:
            self._staging_names.remove(staging.name)
            assert self.engine is not None
            self.engine.unregister(staging.name)

    async def write_layer(self, staging: Staging, handles: Sequence[msg.WriteHandle], layer_index: int,
                          layer_bytes: int, staging_offset: int = 0) -> None:
        """Staging holds one layer's slice of each handle's block, back to back: [len(handles), layer_bytes]."""
        spans = [Span(h.offset + layer_index * layer_bytes, staging_offset + i * layer_bytes, layer_bytes)
                 for i, h in enumerate(handles)]
        await self.move(TransferOp.WRITE, staging, spans, incarnation=incarnation_of(handles))

    async def write_blocks(self, staging: Staging, handles: Sequence[msg.WriteHandle],
                           staging_offset: int = 0) -> None:
        """Staging holds whole blocks back to back: [len(handles), block_bytes]."""
        spans = [Span(h.offset, staging_offset + i * h.num_bytes, h.num_bytes) for i, h in enumerate(handles)]
        await self.move(TransferOp.WRITE, staging, spans, incarnation=incarnation_of(handles))

    async def read_layer(self, staging: Staging, locations: Sequence[msg.BlockLocation], layer_index: int,
                         layer_bytes: int, staging_offset: int = 0) -> None:
        """Fill staging with one layer's slice of each block: [len(locations), layer_bytes]."""
        spans = [Span(_dram_offset(loc) + layer_index * layer_bytes, staging_offset + i * layer_bytes,
                      layer_bytes) for i, loc in enumerate(locations)]
        await self.move(TransferOp.READ, staging, spans, incarnation=incarnation_of(locations))

    async def read_blocks(self, staging: Staging, locations: Sequence[msg.BlockLocation],
                          staging_offset: int = 0) -> None:
        """Fill staging with whole blocks back to back: [len(locations), block_bytes]."""
        spans = [Span(_dram_offset(loc), staging_offset + i * loc.num_bytes, loc.num_bytes)
                 for i, loc in enumerate(locations)]
        await self.move(TransferOp.READ, staging, spans, incarnation=incarnation_of(locations))

    async def move(self, op: TransferOp, staging: Staging | LocalEnd, spans: Sequence[Span],
                   executor: concurrent.futures.Executor | None = None, incarnation: int = 0) -> None:
        """READ: pool -> staging; WRITE: staging -> pool. Raises TransferError or ValueError on failure, and
        StaleOffsets when `incarnation` (the store run the offsets came from; 0: unchecked) is not the store's
        current one. A same-host copy runs on `executor` when given (a worker's copy thread), else off the event
        loop once it is large. A LocalEnd (rank pages, engine/tp_copy.py) is an end of same-host moves only."""
        if not spans:
            return
        pool, segment = await self._current(incarnation)
        if pool is not None:
            if isinstance(staging, Staging):
                copy = functools.partial(_copy_spans, pool.array, staging.array, op, spans)
            else:
                copy = functools.partial(staging.copy_spans, pool.array, op, spans)
            if executor is not None:
                await asyncio.get_running_loop().run_in_executor(executor, copy)
            elif sum(span.num_bytes for span in spans) >= _THREAD_COPY_BYTES:
                await asyncio.to_thread(copy)
            else:
                copy()
            return
        if not isinstance(staging, Staging):
            raise ValueError("rank pages are copied to and from the store on this host only; use staging")
        assert self.engine is not None
        requests = [TransferRequest(op, staging.name, span.staging_offset, segment, span.pool_offset,
                                    span.num_bytes) for span in spans]
        batch_id = self.engine.submit(requests)
        await self.engine.wait(batch_id, self.timeout_s)

    async def _call(self, method: Method, request: Message) -> Any:
        return await self.rpc.call(method, request, timeout_s=self.timeout_s)

    async def _current(self, incarnation: int) -> tuple[ShmPool | None, SegmentRef]:
        """The pool mapping (same host) and segment of the store's current run, learned again after a restart."""
        is_replaced = self.pool is not None and not self.pool.is_current()
        if is_replaced or (incarnation and incarnation != self.incarnation):
            await self._refresh()
        if incarnation and incarnation != self.incarnation:
            raise StaleOffsets(f"the store at {self.segment.endpoint or self.segment.name} restarted since these "
                               f"pool offsets were granted (run {incarnation:x}, now {self.incarnation:x}); "
                               "allocate or look the blocks up again")
        return self.pool, self.segment

    async def _refresh(self) -> None:
        """Learn the store's current run (STATS) and map its pool file: a restarted store made a new one at the
        same path. The mapping belongs to the run named by STATS both before and after it was made (runs never
        repeat), so no move pairs one run's offsets with another run's pool."""
        async with self._refresh_lock:
            for _ in range(3):
                stats: msg.StatsReply = await self._call(msg.STATS, msg.StatsRequest())
                if self.pool is not None and not self.pool.is_current():
                    logger.info("store pool %s was replaced (the store restarted): mapping the new one",
                                self.pool.path)
                    if stats.pool_path != self.pool.path:
                        raise PoolFileRefused(f"the store now reports its pool at {stats.pool_path!r}, not at "
                                              f"{self.pool.path!r} where this worker's config puts it: not mapped")
                    new = await asyncio.to_thread(ShmPool.attach, self.pool.path, True, stats.pool_bytes)
                    old, self.pool = self.pool, new
                    old.close()
                    continue  # confirm the new mapping is the run STATS names
                self.incarnation = stats.incarnation
                self.segment = SegmentRef(stats.segment_endpoint, stats.segment_name)
                return
            raise TransferError(f"the store of pool {stats.pool_path} keeps restarting; try again later")


def incarnation_of(blocks: Iterable[msg.WriteHandle | msg.BlockLocation]) -> int:
    """The store run that granted these handles or locations (one reply's: all the same)."""
    incarnations = {block.incarnation for block in blocks}
    if len(incarnations) > 1:
        raise ValueError(f"handles or locations of several store runs in one move: {sorted(incarnations)}")
    return incarnations.pop() if incarnations else 0


def _copy_spans(pool: np.ndarray, staging: np.ndarray, op: TransferOp, spans: Sequence[Span]) -> None:
    for span in spans:
        if span.staging_offset + span.num_bytes > staging.nbytes or span.staging_offset < 0:
            raise ValueError(f"staging range [{span.staging_offset}, +{span.num_bytes}) is outside its "
                             f"{staging.nbytes} bytes")
        if span.pool_offset < 0 or span.pool_offset + span.num_bytes > pool.nbytes:
            raise ValueError(f"pool range [{span.pool_offset}, +{span.num_bytes}) is outside the pool")
        pool_part = pool[span.pool_offset : span.pool_offset + span.num_bytes]
        staging_part = staging[span.staging_offset : span.staging_offset + span.num_bytes]
        if op is TransferOp.WRITE:
            pool_part[:] = staging_part
        else:
            staging_part[:] = pool_part


def _dram_offset(location: msg.BlockLocation) -> int:
    if location.tier != "dram" or location.offset < 0:
        raise ValueError(f"block {location.key.hex()} is on {location.tier}, not in DRAM: look it up with "
                         "lease_ms > 0 so the store promotes it before reading")
    return location.offset

