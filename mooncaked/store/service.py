"""StoreService: the store's RPC handlers over its metadata, DRAM pool, SSD tier and transfer-engine segment.

1. `start()` creates the shared-memory pool, indexes the SSD directory (its objects become present again),
   registers the pool with the transfer engine as segment `<segment_name>.<incarnation>`, and starts the
   maintenance task. The incarnation (random per run) goes with every pool offset handed out: clients refuse
   offsets of an earlier run of a restarted store, whose pool is gone.
2. Handlers (`add_methods(server)`) call the pure `StoreCore` with `now`; a block it evicts to SSD has its bytes
   copied out of the pool inside the call (`_spill`); a read lease on blocks that are only on SSD promotes them
   back into DRAM before the reply (both in tier_moves.py). A call that appended events wakes the EVENTS streams
   (event_streams.py, which also answers DUMP).
3. The maintenance task (owned here, supervised: an unexpected exception is logged and the loop restarts)
   reclaims expired leases and pins and evicts from the high watermark down to the low one, every
   `maintenance_interval_s`.
4. `stop()`: end the event streams, stop the maintenance task, unregister the segment; with an SSD tier, queue
   every committed DRAM block SSD does not hold yet, most recently used first, ahead of the write-behind backlog
   (a warm restart: the next start indexes them); let the SSD writer work until `stop_timeout_s`; close (and
   unlink) the pool.
"""

from __future__ import annotations

import asyncio
import secrets
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from mooncaked.kv.store_core import TIER_DRAM, Eviction, Grant, Location, StoreConfig, StoreCore, StoreFull, UnknownHandle
from mooncaked.kv.tenant_quota import TenantShare
from mooncaked.rpc import InvalidArgument, Method, NotFound, ResourceExhausted, RpcError
from mooncaked.runtime.supervised import start_supervised, stop_task
from mooncaked.store import messages as msg
from mooncaked.store.event_streams import EventStreams
from mooncaked.store.shm_pool import ShmPool
from mooncaked.store.ssd import SsdConfig, SsdTier
from mooncaked.store.tier_moves import TierMoves
from mooncaked.transfer import TransferEngine

logger = logging.getLogger(__name__)

MAX_TENANT_CHARS = 64  # tenant ids are metric labels: bounded (api/tenants.py)


class MethodRegistry(Protocol):
    """The part of mooncaked.rpc.RpcServer the service uses."""

    def add_method(self, method: Any, handler: Any, *, is_eager: bool = False) -> None: ...


@dataclass(frozen=True)
class StoreServiceConfig:
    pool_path: str
    dram_bytes: int
    host: str  # host identity reported to clients (same host: map the pool)
    segment_name: str = "kvpool"
    eviction_policy: str = "lru"
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    ssd_dir: str | None = None
    ssd_bytes: int = 0
    max_lease_ms: int = 600_000
    max_pin_ms: int = 86_400_000  # longest PIN (a context cache's longest TTL: conductor.max_cache_ttl_s)
    max_events: int = 100_000
    maintenance_interval_s: float = 0.5
    stop_timeout_s: float = 5.0
    alignment: int = 4096
    numa_node: int | None = None  # the pool's pages are bound there and registered as "cpu:N" (None: unbound)


class StoreService:
    """Owns the store's core (metadata), pool, SSD tier, event streams and maintenance task; borrows the transfer
    engine."""

    def __init__(self, config: StoreServiceConfig, engine: TransferEngine | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.engine = engine
        self.clock = clock
        self.incarnation = secrets.randbits(62) + 1  # tells this run's pool offsets from a restarted store's
        self.segment_name = f"{config.segment_name}.{self.incarnation:x}"  # old runs' transfers find no segment
        has_ssd = config.ssd_dir is not None and config.ssd_bytes > 0
        self.core = StoreCore(StoreConfig(
            capacity_bytes=config.dram_bytes, alignment=config.alignment, eviction_policy=config.eviction_policy,
            high_watermark=config.high_watermark, low_watermark=config.low_watermark, has_ssd=has_ssd,
            max_events=config.max_events, first_id=1 + secrets.randbits(60)), self._spill if has_ssd else None)
        self.ssd: SsdTier | None = None
        if has_ssd:
            assert config.ssd_dir is not None
            self.ssd = SsdTier(SsdConfig(config.ssd_dir, config.ssd_bytes, config.eviction_policy),
                               self.core.is_ssd_evictable, self._on_ssd_dropped, self.core.ssd_written)
        self.moves = TierMoves(self.core, self.ssd, clock)
        self.pool: ShmPool | None = None
        self._maintenance: asyncio.Task[None] | None = None
        self.streams = EventStreams(self.core)

    # ---- lifecycle ----------------------------------------------------------------------------------------
    async def start(self) -> None:
        self.pool = ShmPool.create(self.config.pool_path, self.config.dram_bytes, numa_node=self.config.numa_node)
        if self.ssd is not None:
            for key, num_bytes in self.ssd.start(self.clock()):
                self.core.ssd_loaded(key, num_bytes)
            logger.info("store: %d objects indexed on ssd at %s", len(self.ssd), self.config.ssd_dir)
        if self.engine is not None:
            self.engine.register(self.segment_name, self.pool.view, f"cpu:{self.config.numa_node or 0}")
        self._maintenance = start_supervised("store-maintenance", self._maintain)

    async def stop(self) -> None:
        self.streams.end()
        await stop_task(self._maintenance)
        self._maintenance = None
        if self.engine is not None and self.pool is not None:
            self.engine.unregister(self.segment_name)
        if self.ssd is not None:
            await self.moves.stop_ssd(self.pool, self.config.stop_timeout_s)
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def add_methods(self, server: MethodRegistry) -> None:
        handlers: dict[Method, Callable[..., Any]] = {
            msg.ALLOCATE: self.allocate, msg.COMMIT: self.commit, msg.ABORT: self.abort,
            msg.LOOKUP: self.lookup, msg.RELEASE: self.release, msg.PIN: self.pin, msg.UNPIN: self.unpin,
            msg.STATS: self.stats, msg.MARK_SPARE: self.mark_spare,
            msg.EVENTS: self.streams.events, msg.DUMP: self.streams.dump,
        }
        for method, handler in handlers.items():
            # Unary handlers are eager: most never suspend, so running them inline saves a task per call.
            server.add_method(method, handler, is_eager=not method.is_streaming)

    # ---- handlers -----------------------------------------------------------------------------------------
    async def allocate(self, request: msg.AllocateRequest, ctx: object) -> msg.AllocateReply:
        self._check_lease(request.lease_ms)
        now = self.clock()
        if len(request.tenant) > MAX_TENANT_CHARS:
            raise InvalidArgument(f"tenant must be at most {MAX_TENANT_CHARS} characters")
        grants, present, lease_id = self._call(
            lambda: self.core.allocate(request.keys, request.num_bytes, request.lease_ms, now,
                                       request.first_position, request.tenant, _share(request)))
        if any(location.tier != TIER_DRAM for location in present):
            present = await self.moves.promote(present, self._place)
            try:
                grants += self._grant_dropped(request, present)
            except RpcError:
                self.core.release([lease_id])
                self._call(lambda: self.core.abort([g.handle_id for g in grants]))
                raise
            present = [location for location in present if location.tier == TIER_DRAM]
        handles = [msg.WriteHandle(g.handle_id, g.key, g.offset, g.num_bytes, self.incarnation) for g in grants]
        return msg.AllocateReply(handles, [self._location_message(loc) for loc in present], lease_id)

    def _grant_dropped(self, request: msg.AllocateRequest, present: Sequence[Location]) -> list[Grant]:
        """Every key must come back present in DRAM or with a write handle: a key whose SSD copy was found corrupt
        while promoting is absent now and gets a handle; one that stays on SSD (no DRAM room) fails the call."""
        if any(loc.tier != TIER_DRAM and self.core.location(loc.key) is not None for loc in present):
            raise ResourceExhausted("store full: blocks on SSD cannot be brought back into DRAM (nothing "
                                    "evictable left); retry later")
        position_of = {key: request.first_position + i for i, key in enumerate(request.keys)}
        grants: list[Grant] = []
        try:
            for location in present:
                if location.tier != TIER_DRAM:
                    key = location.key
                    grants += self._call(lambda: self.core.allocate([key], request.num_bytes, request.lease_ms,
                                                                    self.clock(), position_of[key], request.tenant,
                                                                    _share(request)))[0]
        except RpcError:
            self._call(lambda: self.core.abort([g.handle_id for g in grants]))
            raise
        return grants

    async def commit(self, request: msg.CommitRequest, ctx: object) -> msg.CommitReply:
        num_new, num_duplicates = self._call(lambda: self.core.commit(request.handle_ids, self.clock()))
        return msg.CommitReply(num_new, num_duplicates)

    async def abort(self, request: msg.AbortRequest, ctx: object) -> msg.AbortReply:
        return msg.AbortReply(self._call(lambda: self.core.abort(request.handle_ids)))

    async def lookup(self, request: msg.LookupRequest, ctx: object) -> msg.LookupReply:
        if request.lease_ms:
            self._check_lease(request.lease_ms)
        locations, lease_id = self._call(lambda: self.core.lookup(request.keys, self.clock(), request.lease_ms))
        if lease_id and any(location.tier != TIER_DRAM for location in locations):
            promoted = await self.moves.promote(locations, self._place)
            locations = promoted[: next((i for i, loc in enumerate(promoted) if loc.tier != TIER_DRAM),
                                        len(promoted))]
        return msg.LookupReply([self._location_message(loc) for loc in locations], lease_id)

    async def release(self, request: msg.ReleaseRequest, ctx: object) -> msg.ReleaseReply:
        return msg.ReleaseReply(self.core.release(request.lease_ids))

    async def pin(self, request: msg.PinRequest, ctx: object) -> msg.PinReply:
        if not 0 < request.ttl_ms <= self.config.max_pin_ms:
            raise InvalidArgument(f"ttl_ms must be in 1..{self.config.max_pin_ms}, got {request.ttl_ms}")
        return msg.PinReply(self._call(lambda: self.core.pin(request.keys, request.ttl_ms, self.clock())))

    async def unpin(self, request: msg.UnpinRequest, ctx: object) -> msg.UnpinReply:
        return msg.UnpinReply(self._call(lambda: self.core.unpin(request.keys)))

    async def mark_spare(self, request: msg.MarkSpareRequest, ctx: object) -> msg.MarkSpareReply:
        return msg.MarkSpareReply(self._call(lambda: self.core.mark_spare(request.spare_keys, request.kept_keys)))

    async def stats(self, request: msg.StatsRequest, ctx: object) -> msg.StatsReply:
        counters = self.core.stats()
        if self.ssd is not None:
            counters.update(ssd_used_bytes=self.ssd.num_used_bytes, ssd_num_corrupt=self.ssd.num_corrupt,
                            ssd_pending_bytes=self.ssd.num_pending_bytes,
                            ssd_num_failed_writes=self.ssd.num_failed_writes)
        assert self.pool is not None, "stats before start()"
        endpoint = self.engine.endpoint if self.engine is not None else ""
        return msg.StatsReply(counters, self.pool.path, self.pool.num_bytes, endpoint, self.segment_name,
                              self.config.host, self.incarnation)

    # ---- internals ----------------------------------------------------------------------------------------
    def _call(self, operation: Callable[[], Any]) -> Any:
        """Run one core operation; map its errors to RPC errors; wake event streams."""
        last_seq = self.core.events.last_seq
        try:
            return operation()
        except UnknownHandle as error:
            raise NotFound(str(error.args[0])) from None
        except StoreFull as error:
            raise ResourceExhausted(str(error)) from None
        except ValueError as error:
            raise InvalidArgument(str(error)) from None
        finally:
            if self.core.events.last_seq != last_seq:
                self.streams.notify()

    def _check_lease(self, lease_ms: int) -> None:
        if not 0 < lease_ms <= self.config.max_lease_ms:
            raise InvalidArgument(f"lease_ms must be in 1..{self.config.max_lease_ms}, got {lease_ms}")

    def _spill(self, eviction: Eviction) -> bool:
        return self.moves.spill(self.pool, eviction)

    def _place(self, key: bytes, data: bytes) -> None:
        offset = self._call(lambda: self.core.place_promoted(key, self.clock()))
        if offset is not None:
            assert self.pool is not None
            self.pool.write(offset, data)  # what was evicted from there was spilled inside the call

    def _on_ssd_dropped(self, key: bytes) -> None:
        self.core.ssd_dropped(key)
        self.streams.notify()

    def _location_message(self, location: Location) -> msg.BlockLocation:
        return msg.BlockLocation(location.key, location.tier, location.offset, location.num_bytes, self.incarnation)

    async def _maintain(self) -> None:
        while True:
            await asyncio.sleep(self.config.maintenance_interval_s)
            try:
                self._call(lambda: (self.core.expire(self.clock()), self.core.evict_to_watermark(self.clock())))
            except RpcError as error:
                logger.error("store maintenance failed: %s", error)


def _share(request: msg.AllocateRequest) -> TenantShare | None:
    """The request's tenant shares (None without a tenant); bad values raise ValueError (InvalidArgument)."""
    if not request.tenant:
        return None
    return TenantShare(request.pool_share, request.min_pool_share)
