"""A decode instance's reservations: KV pages set aside and store space allocated for prefilled requests to come.

1. `add` records a reservation RESERVE accepted and queues it for pages; `allocate` takes store space on this host
   for the prompt blocks it lacks (plus a private block for the partial tail) and `reply` names them as
   destinations.
2. `grant` gives pages to queued reservations in queue order (interactive first, then priority, then arrival),
   each as soon as the allocator has its pages and the batch a slot: the pages are allocated to the reservation's
   own owner, so the free count is the allocator's and never more pages are set aside than exist. It runs
   whenever pages free (`pages_freed`: a sequence ended, a reservation was dropped).
3. DECODE claims a reservation (`get`), waits for its pages (`wait_granted`, bounded by the reservation's page
   deadline: its predicted decode start plus `worker.page_wait_s`), and its request's KV takes them over
   (`RequestKv(..., reserved_by=reservation.owner)`): from then on they are the request's, counted once. The
   reservation is dropped once its KV is loaded; UNRESERVE, a lease running out (`expire`, every EXPIRY_PERIOD_S
   from `start` to `stop`, not only on the next RESERVE), its conductor calling again as a new run
   (`drop_orphans`: it restarted) or the role stopping (`close`) drop it too. Dropping frees the
   pages it still holds at once (granting them to the next in line) and aborts the store handles, after
   `abort_grace_s` when a prefill may still write.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from mooncaked.engine.page_allocator import PageAllocator
from mooncaked.roles.worker.decode.room import Room
from mooncaked.roles.worker.kv.plan import store_owner
from mooncaked.roles.worker.messages import Destination, ReserveReply, ReserveRequest
from mooncaked.roles.worker.worker import Worker
from mooncaked.rpc import Unavailable
from mooncaked.runtime.supervised import start_supervised, stop_task
from mooncaked.sched.decode_memory import DecodeHold, is_decoding
from mooncaked.sched.priority import queue_rank
from mooncaked.store.client import incarnation_of
from mooncaked.store.messages import BlockLocation, WriteHandle

logger = logging.getLogger(__name__)

EXPIRY_PERIOD_S = 1.0  # how late past its lease an unclaimed reservation may be given back


@dataclass
class Reservation:
    """Pages set aside and store space allocated for one request. Its pages, once granted, are held by `owner` in
    the worker's page allocator until its request takes them over."""

    request: ReserveRequest
    num_pages: int
    expires_at: float
    conductor: str = ""  # the instance that reserved it (its run: request.conductor_run)
    handles: list[WriteHandle] = field(default_factory=list)
    present: list[BlockLocation] = field(default_factory=list)
    lease_id: int = 0
    tail: WriteHandle | None = None
    rank: tuple[int, int, float] = (0, 0, 0.0)  # its place in the page queue (sched/priority.py)
    decode_start_at: float = 0.0  # time.monotonic() of its predicted decode start (the conductor's forecast)
    page_deadline: float = 0.0  # DECODE waits for its pages until then
    granted: asyncio.Event = field(default_factory=asyncio.Event)
    is_claimed: bool = False  # DECODE took it: its pages are the request's (or about to be)
    is_at_decode: bool = False  # its pages are wanted only from DECODE on (admitted on the forecast at decode start)

    @property
    def num_seqs(self) -> int:
        """Batch slots it takes: its sequences, none when its request does not decode (decode_memory.is_decoding)."""
        return self.request.num_sequences if is_decoding(self.request.max_tokens, self.request.is_inline_prefill) else 0

    @property
    def owner(self) -> str:
        """The page allocator's owner of its granted pages (its request takes them over)."""
        return f"{self.request.request_id}#reserved"

    @property
    def incarnation(self) -> int:
        """The store run every handle and location of this reservation belongs to."""
        tail = [] if self.tail is None else [self.tail]
        return incarnation_of([*self.present, *self.handles, *tail])


class ReservationBook:
    """Owns the reservations, the deferred store aborts and the room RESERVE calls wait on (owned by the
    DecodeRole)."""

    def __init__(self, worker: Worker, num_running: Callable[[], int]) -> None:
        self.worker = worker
        self.num_running = num_running  # sequences in the decode batch (the DecodeLoop's)
        self.by_id: dict[str, Reservation] = {}
        self.room = Room()
        self._deferred_aborts: set[asyncio.Task[None]] = set()
        self._expiry_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Expire unclaimed reservations every EXPIRY_PERIOD_S, whether or not another RESERVE comes."""
        self._expiry_task = start_supervised("reservation-expiry", self._expire_loop)

    async def stop(self) -> None:
        task, self._expiry_task = self._expiry_task, None
        await stop_task(task)

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_PERIOD_S)
            await self.expire()

    def __len__(self) -> int:
        return len(self.by_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.by_id

    def get(self, request_id: str) -> Reservation | None:
        return self.by_id.get(request_id)

    def num_queued(self) -> int:
        """Reservations waiting in the queue for pages (wanted now)."""
        return sum(1 for r in self._queued())

    def num_queued_pages(self) -> int:
        """Pages the reservations waiting in the queue need (wanted now)."""
        return sum(r.num_pages for r in self._queued())

    def _queued(self) -> list[Reservation]:
        return [r for r in self.by_id.values() if not r.granted.is_set() and (r.is_claimed or not r.is_at_decode)]

    def num_prompt_tokens(self) -> int:
        return sum(r.request.num_prompt_tokens * r.num_seqs for r in self.by_id.values())

    def num_prefilling(self) -> int:
        """Reservations DECODE has not claimed yet: their prompts are still queued or prefilling elsewhere."""
        return sum(1 for r in self.by_id.values() if not r.is_claimed)

    def num_sequences(self) -> int:
        return sum(r.num_seqs for r in self.by_id.values())

    def next_expiry(self, default: float) -> float:
        return min((r.expires_at for r in self.by_id.values()), default=default)

    def add(self, request: ReserveRequest, num_pages: int, conductor: str = "", is_at_decode: bool = False
            ) -> Reservation:
        """Record the reservation and queue it for pages, granted when they are free: at once, or with
        `is_at_decode` once DECODE claims it (a prefill's seconds hold no pages that a request decoding meanwhile
        could use; the forecast it was admitted on counts its pages from its predicted decode start)."""
        now = time.monotonic()
        decode_start_at = now + request.decode_start_s
        reservation = Reservation(request, num_pages, now + request.lease_ms / 1000, conductor,
                                  rank=queue_rank(request.is_batch, request.priority, now),
                                  decode_start_at=decode_start_at,
                                  page_deadline=decode_start_at + self.worker.section.page_wait_s,
                                  is_at_decode=is_at_decode)
        self.by_id[request.request_id] = reservation
        self.grant()
        if not reservation.granted.is_set() and not is_at_decode:
            logger.info("reservation %s waits for %d KV pages (%d free)", request.request_id, num_pages,
                        self._pages().num_free)
        return reservation

    def grant(self) -> None:
        """Pages and batch slots to queued reservations, in queue order; the first that does not fit stops it."""
        pages = self._pages()
        num_seqs = self.num_running() + sum(r.num_seqs for r in self.by_id.values() if r.granted.is_set())
        queued = (r for r in self.by_id.values() if not r.granted.is_set() and (r.is_claimed or not r.is_at_decode))
        for reservation in sorted(queued, key=lambda r: r.rank):
            num_more = reservation.num_seqs
            if reservation.num_pages > pages.num_free or num_seqs + num_more > self.worker.section.max_batch_size:
                return
            pages.allocate(reservation.num_pages, owner=reservation.owner)
            reservation.granted.set()
            num_seqs += num_more

    async def wait_granted(self, reservation: Reservation, deadline: float) -> bool:
        """Whether the reservation's pages were granted by `deadline` (time.monotonic())."""
        if not reservation.granted.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(reservation.granted.wait(), max(deadline - time.monotonic(), 0.0))
        return reservation.granted.is_set()

    async def pages_freed(self) -> None:
        """Pages or a batch slot came free: grant them, and wake RESERVE calls waiting for room."""
        self.grant()
        await self.room.freed()

    def holds(self, now: float, step_s: float) -> list[DecodeHold]:
        """What the reservations will hold (sched/decode_memory.py): their pages from their predicted decode start
        for their predicted output (max_tokens when the conductor predicted none) at `step_s` a token."""
        holds = []
        for r in self.by_id.values():
            starts_at = now if r.is_claimed else max(r.decode_start_at, now)
            num_tokens = r.request.predicted_output_tokens or r.request.max_tokens
            holds.append(DecodeHold(r.num_pages, starts_at, starts_at + max(num_tokens, 1) * step_s, r.num_seqs))
        return holds

    def _pages(self) -> PageAllocator:
        pages = self.worker.pages
        assert pages is not None, "reservations are made on a started worker"
        return pages

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
        request, store = reservation.request, self.worker.stores.local
        owner = store_owner(request.tenant)
        reply = await store.allocate(request.block_keys, self.worker.block_nbytes, request.lease_ms, **owner)
        reservation.handles, reservation.present, reservation.lease_id = reply.handles, reply.present, \
            reply.read_lease_id
        if request.num_prompt_tokens % self.worker.block_size and reservation.num_seqs:  # a tail only to decode on
            tail_key = hashlib.blake2b(request.request_id.encode() + os.urandom(8), digest_size=16).digest()
            tail = await store.allocate([tail_key], self.worker.block_nbytes, request.lease_ms, **owner)
            reservation.tail = tail.handles[0]
            blocks: list[BlockLocation | WriteHandle] = [*reply.present, *reply.handles, *tail.handles]
            runs = {block.incarnation for block in blocks}
            if len(runs) > 1:
                raise Unavailable("this host's store restarted while the reservation was made; reserve again")

    async def give_back_allocation(self, reservation: Reservation) -> None:
        """End the store space `allocate` took (no prefill was told of it yet, so at once)."""
        handle_ids = [h.handle_id for h in reservation.handles]
        if reservation.tail is not None:
            handle_ids.append(reservation.tail.handle_id)
        lease_id = reservation.lease_id
        reservation.handles, reservation.present, reservation.lease_id, reservation.tail = [], [], 0, None
        # no room change: the caller tries again at once, and a change of its own would end its next wait at once
        await self._end_store_handles(handle_ids, lease_id, 0.0, is_room_freed=False)

    def reply(self, reservation: Reservation) -> ReserveReply:
        index_of = {key: i for i, key in enumerate(reservation.request.block_keys)}
        destinations = [Destination(index_of[h.key], h) for h in reservation.handles]
        if reservation.tail is not None:
            destinations.append(Destination(len(reservation.request.block_keys), reservation.tail))
        return ReserveReply(is_accepted=True, store_instance=self.worker.stores.local_name,
                            destinations=destinations, num_present_blocks=len(reservation.present))

    async def drop(self, request_id: str, is_prefill_done: bool = True) -> None:
        """Give the pages back at once; abort the store handles once no prefill can still write into them."""
        reservation = self.by_id.pop(request_id, None)
        if reservation is None:
            return
        self._pages().free_owner(reservation.owner)  # none left once its request took them over
        await self.pages_freed()
        handle_ids = [h.handle_id for h in reservation.handles]
        if reservation.tail is not None:
            handle_ids.append(reservation.tail.handle_id)
        delay_s = 0.0 if is_prefill_done else self.worker.section.abort_grace_s
        task = asyncio.create_task(self._end_store_handles(handle_ids, reservation.lease_id, delay_s))
        self._deferred_aborts.add(task)
        task.add_done_callback(self._deferred_aborts.discard)
        if is_prefill_done:
            await task

    async def _end_store_handles(self, handle_ids: list[int], lease_id: int, delay_s: float,
                                 is_room_freed: bool = True) -> None:
        store = self.worker.stores.local
        try:
            if lease_id:
                await store.release([lease_id])
            await asyncio.sleep(delay_s)  # a cancelled prefill's writes in flight land in reserved space
            if handle_ids:
                await store.abort(handle_ids)
                if is_room_freed:
                    await self.room.freed()  # a RESERVE may wait for this store space (admission.allocate_store)
        except Exception as exc:
            logger.warning("ending a reservation's store lease and %d handles failed (%s: %s); the store reclaims "
                           "them when their lease expires", len(handle_ids), type(exc).__name__, exc)

    async def close(self) -> None:
        """Stop the expiry; drop every reservation; deferred aborts are cancelled (the store reclaims those at lease
        expiry)."""
        await self.stop()
        for request_id in list(self.by_id):
            await self.drop(request_id, is_prefill_done=False)
        for task in list(self._deferred_aborts):
            task.cancel()
        await asyncio.gather(*self._deferred_aborts, return_exceptions=True)
