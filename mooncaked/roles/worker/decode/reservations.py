"""A decode instance's reservations: pages set aside and store space allocated for prefilled requests to come.

1. `add` records a reservation RESERVE accepted; `allocate` takes store space on this host for the prompt blocks
   it lacks (plus a private block for the partial tail) and `reply` names them as destinations.
2. DECODE claims a reservation (`get`) and drops it once its KV is loaded; UNRESERVE, a lease running out
   (`expire`), its conductor calling again as a new run (`drop_orphans`: it restarted) or the role stopping
   (`close`) drop it too. Dropping gives the pages back at once (waking RESERVE
   calls waiting for room) and aborts the store handles, after `abort_grace_s` when a prefill may still write.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from mooncaked.roles.worker.kv.plan import store_owner
from mooncaked.roles.worker.messages import Destination, ReserveReply, ReserveRequest
from mooncaked.roles.worker.worker import Worker
from mooncaked.rpc import Unavailable
from mooncaked.store.client import incarnation_of
from mooncaked.store.messages import BlockLocation, WriteHandle

logger = logging.getLogger(__name__)


class Room:
    """Wakes RESERVE calls waiting for KV pages or a batch slot (owned by the ReservationBook)."""

    def __init__(self) -> None:
        self._changed = asyncio.Condition()

    async def freed(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def wait_until(self, refusal: Callable[[], str], timeout_s: float) -> str:
        """Wait until `refusal()` is "" or `timeout_s` runs out; returns the last refusal ("" once there is room)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        async with self._changed:
            while reason := refusal():
                left_s = deadline - loop.time()
                if left_s <= 0:
                    return reason
                try:
                    await asyncio.wait_for(self._changed.wait(), left_s)
                except TimeoutError:
                    return refusal()
            return ""


@dataclass
class Reservation:
    """Pages set aside and store space allocated for one request."""

    request: ReserveRequest
    num_pages: int
    expires_at: float
    conductor: str = ""  # the instance that reserved it (its run: request.conductor_run)
    handles: list[WriteHandle] = field(default_factory=list)
    present: list[BlockLocation] = field(default_factory=list)
    lease_id: int = 0
    tail: WriteHandle | None = None

    @property
    def incarnation(self) -> int:
        """The store run every handle and location of this reservation belongs to."""
        tail = [] if self.tail is None else [self.tail]
        return incarnation_of([*self.present, *self.handles, *tail])


class ReservationBook:
    """Owns the reservations, the deferred store aborts and the room RESERVE calls wait on (owned by the
    DecodeRole)."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.by_id: dict[str, Reservation] = {}
        self.room = Room()
        self._deferred_aborts: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self.by_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.by_id

    def get(self, request_id: str) -> Reservation | None:
        return self.by_id.get(request_id)

    def num_pages(self) -> int:
        return sum(r.num_pages for r in self.by_id.values())

    def num_prompt_tokens(self) -> int:
        return sum(r.request.num_prompt_tokens for r in self.by_id.values())

    def next_expiry(self, default: float) -> float:
        return min((r.expires_at for r in self.by_id.values()), default=default)

    def add(self, request: ReserveRequest, num_pages: int, conductor: str = "") -> Reservation:
        reservation = Reservation(request, num_pages, time.monotonic() + request.lease_ms / 1000, conductor)
        self.by_id[request.request_id] = reservation
        return reservation

    async def expire(self) -> None:
        now = time.monotonic()
        for request_id in [r for r, res in self.by_id.items() if res.expires_at < now]:
            logger.info("reservation %s expired unclaimed", request_id)
            await self.drop(request_id, is_prefill_done=False)

    async def drop_orphans(self, conductor: str, run: int) -> None:
        """`conductor` calls as run `run`: its earlier runs' reservations will never be claimed (that process is
        gone; a restarted conductor does not know them), so they are dropped now, not at their lease's end."""
        if not run:
            return
        for request_id in [r for r, res in self.by_id.items()
                           if res.conductor == conductor and res.request.conductor_run not in (0, run)]:
            logger.info("reservation %s dropped: %s restarted since it reserved", request_id, conductor)
            await self.drop(request_id, is_prefill_done=False)

    async def allocate(self, reservation: Reservation) -> None:
        request, store = reservation.request, self.worker.local_store
        owner = store_owner(request.tenant)
        reply = await store.allocate(request.block_keys, self.worker.block_nbytes, request.lease_ms, **owner)
        reservation.handles, reservation.present, reservation.lease_id = reply.handles, reply.present, \
            reply.read_lease_id
        if request.num_prompt_tokens % self.worker.block_size:
            tail_key = hashlib.blake2b(request.request_id.encode() + os.urandom(8), digest_size=16).digest()
            tail = await store.allocate([tail_key], self.worker.block_nbytes, request.lease_ms, **owner)
            reservation.tail = tail.handles[0]
            blocks: list[BlockLocation | WriteHandle] = [*reply.present, *reply.handles, *tail.handles]
            runs = {block.incarnation for block in blocks}
            if len(runs) > 1:
                raise Unavailable("this host's store restarted while the reservation was made; reserve again")

    def reply(self, reservation: Reservation) -> ReserveReply:
        index_of = {key: i for i, key in enumerate(reservation.request.block_keys)}
        destinations = [Destination(index_of[h.key], h) for h in reservation.handles]
        if reservation.tail is not None:
            destinations.append(Destination(len(reservation.request.block_keys), reservation.tail))
        return ReserveReply(is_accepted=True, store_instance=self.worker.local_store_name,
                            destinations=destinations, num_present_blocks=len(reservation.present))

    async def drop(self, request_id: str, is_prefill_done: bool = True) -> None:
        """Give the pages back at once; abort the store handles once no prefill can still write into them."""
        reservation = self.by_id.pop(request_id, None)
        if reservation is None:
            return
        await self.room.freed()
        handle_ids = [h.handle_id for h in reservation.handles]
        if reservation.tail is not None:
            handle_ids.append(reservation.tail.handle_id)
        delay_s = 0.0 if is_prefill_done else self.worker.section.abort_grace_s
        task = asyncio.create_task(self._end_store_handles(handle_ids, reservation.lease_id, delay_s))
        self._deferred_aborts.add(task)
        task.add_done_callback(self._deferred_aborts.discard)
        if is_prefill_done:
            await task

    async def _end_store_handles(self, handle_ids: list[int], lease_id: int, delay_s: float) -> None:
        store = self.worker.local_store
        try:
            if lease_id:
                await store.release([lease_id])
            await asyncio.sleep(delay_s)  # a cancelled prefill's writes in flight land in reserved space
            if handle_ids:
                await store.abort(handle_ids)
        except Exception as exc:
            logger.warning("ending a reservation's store lease and %d handles failed (%s: %s); the store reclaims "
                           "them when their lease expires", len(handle_ids), type(exc).__name__, exc)

    async def close(self) -> None:
        """Drop every reservation; deferred aborts are cancelled (the store reclaims those at lease expiry)."""
        for request_id in list(self.by_id):
            await self.drop(request_id, is_prefill_done=False)
        for task in list(self._deferred_aborts):
            task.cancel()
        await asyncio.gather(*self._deferred_aborts, return_exceptions=True)
